#!/usr/bin/env bash
# Issue 35's goal for a 16-core CPU (Esper at least 2x esper-lite per PPO update, 4 envs),
# measured on the device tool's machine, whose 16 CPU cores are the only such CPU this
# project can reach: ../shared/peer/side_by_side.sh run there, rounds interleaved, on the
# CPU (the GPU idle). Two steps, since that machine reaches no package index and the
# ../shared folder does not travel with the working tree:
#   here:   bash benchmarks/cpu_session.sh prepare
#           the wheels that machine lacks (Esper's CLI: jsonargparse; esper-lite: pydantic)
#           into .whl/, esper-lite and the side-by-side script into .peer/ (both ignored
#           by git; about 9 MB)
#   there:  run(command="bash benchmarks/cpu_session.sh run", carry=[".whl", ".peer"])
#           the table lands in $OUT/cpu_side_by_side.txt; before it, benchmarks/workers.py
#           at 4 envs in 4 threads and in 4 processes ($OUT/cpu_workers.txt: whether the
#           interpreter lock that the worker threads share costs a 16-core CPU what
#           processes would save)
# ESPER_CPU_ENVS (default 4) and ESPER_CPU_ROUNDS (default 3: about 3 minutes there) size
# the run, ESPER_SIDE_TIMEOUT (default 480 s) bounds the side-by-side, ESPER_CPU_WORKERS=0
# leaves out workers.py; PYTHON names the interpreter (default python3); DEVICE_PYTHON_VERSION the
# Python the wheels are for (default 3.12, the machine's). Esper runs from src/ with the
# machine's torch, esper-lite from .peer/src with the same.
# The same comparison on the GPU (issue 35's 3x esper-lite per update, 16 envs):
# ESPER_SIDE_DEVICE=cuda ESPER_CPU_ENVS=16, and ESPER_ENGINE=stacked to run Esper with
# --model.engine stacked (default: Esper's default engine); the table then lands in
# $OUT/cuda_side_by_side.txt.
set -u -o pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
# Pinned: what was fetched and tried when this was written (jsonargparse's signature
# extras, pydantic and what each needs beyond the machine's own packages).
WHEELS=(
  jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
  importlib-resources==7.1.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
)

prepare() {
  local peer=$root/../shared/peer
  [ -f "$peer/side_by_side.sh" ] || { echo "no $peer/side_by_side.sh: run this from a checkout beside shared/"; exit 1; }
  cd "$root" && rm -rf .whl .peer && mkdir -p .whl .peer || exit 1
  "$py" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "${DEVICE_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}" || exit 1
  cp "$peer/side_by_side.sh" "$peer/run_peer.py" .peer/ || exit 1
  tar -xzf "$peer"/esper-lite-*.tar.gz -C .peer || exit 1
  du -sh .whl .peer
}

run() {
  cd "$root" || exit 1
  [ -d .whl ] && [ -f .peer/side_by_side.sh ] || { echo "no .whl/ or .peer/: run 'prepare' here first and carry both"; exit 1; }
  local out=${OUT:-$(mktemp -d)} site wrap python device=${ESPER_SIDE_DEVICE:-cpu} engine=""
  [ -n "${ESPER_ENGINE:-}" ] && engine=" --model.engine $ESPER_ENGINE"
  site=$(mktemp -d) wrap=$(mktemp -d) python=$(command -v "$py") || exit 1
  python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")  # the launchers run elsewhere
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
  # side_by_side.sh runs "$ESPER fit ..." and "$PEER_VENV/bin/python run_peer.py ...": the
  # two are given as small launchers, each with its own package on the path (both are
  # called esper) and the carried wheels.
  # (A PYTHONPATH already set stays on both paths, after them.)
  site=$site${PYTHONPATH:+:$PYTHONPATH}
  printf '#!/bin/sh\nPYTHONPATH=%s/src:%s exec %s -m esper "$@"%s\n' "$root" "$site" "$python" \
    "$engine" > "$wrap/esper"
  mkdir -p "$wrap/peer/bin"
  printf '#!/bin/sh\nPYTHONPATH=%s/.peer/src:%s exec %s "$@"\n' "$root" "$site" "$python" \
    > "$wrap/peer/bin/python"
  chmod +x "$wrap/esper" "$wrap/peer/bin/python"
  "$wrap/esper" --help > /dev/null || { echo "Esper's CLI does not start here"; exit 1; }
  "$python" -c "import os, torch; print(f'{os.cpu_count()} CPUs, torch {torch.__version__}, \
{torch.get_num_threads()} intra-op threads')" | tee "$out/${device}_side_by_side.txt"
  echo "Esper run as: $wrap/esper fit ...$engine" | tee -a "$out/${device}_side_by_side.txt"
  if [ "$device" = cpu ] && [ "${ESPER_CPU_WORKERS:-1}" != 0 ]; then
    # Threads or processes on this CPU (the interpreter lock's cost at 4 workers, each op
    # on one core): benchmarks/workers.py, before the comparison, alone on the machine.
    PYTHONPATH=$root/src:$site timeout 90 "$python" benchmarks/workers.py --n-envs 4 \
      --workers 4 --updates 1 --repeats 2 2>&1 | grep -v "available:" | tee "$out/cpu_workers.txt"
  fi
  ESPER="$wrap/esper" PEER_VENV="$wrap/peer" timeout "${ESPER_SIDE_TIMEOUT:-480}" bash .peer/side_by_side.sh \
    --envs "${ESPER_CPU_ENVS:-4}" --rounds "${ESPER_CPU_ROUNDS:-3}" --device "$device" 2>&1 \
    | tee -a "$out/${device}_side_by_side.txt"
}

case ${1:-} in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: bash benchmarks/cpu_session.sh prepare|run"; exit 2 ;;
esac
