#!/usr/bin/env bash
# Issue 35's GPU checks as one device call: the CUDA tests, then benchmarks/gpu.py for
# both engines, then benchmarks/dispatch.py on CUDA. Written for the `device` tool's
# machines (torch, lightning, pytest and hypothesis installed there; no network), where
# it runs from the repository root as
#   bash benchmarks/gpu_session.sh            (figures and logs land in $OUT)
# ESPER_GPU_ENVS / ESPER_GPU_EPOCHS shrink the benchmark (default "4 16 64" and 2);
# PYTHON names the interpreter (default python3); ESPER_GPU_DEVICE=cpu tries it on a CPU.
# Esper runs from src/ with the machine's torch (no install: the pinned CPU torch is not
# what a GPU wants, and GAE falls back to tensor ops without its C kernel).
set -u -o pipefail
out=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
envs=${ESPER_GPU_ENVS:-4 16 64}
epochs=${ESPER_GPU_EPOCHS:-2}
py=${PYTHON:-python3}
device=${ESPER_GPU_DEVICE:-cuda}
"$py" - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, {name}, {torch.get_num_threads()} CPU threads")
PY
# CUDA tests of the host-training paths (stacked vs per-env, streams, AMP, rollout reads).
timeout 180 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/tolaria tests/mdp \
  tests/kasmina 2>&1 | tee "$out/gpu_tests.txt"
# shellcheck disable=SC2086  # envs is a list of counts
timeout 330 "$py" benchmarks/gpu.py --device "$device" --n-envs $envs --epochs "$epochs" 2>&1 \
  | tee "$out/gpu_bench.txt"
timeout 60 "$py" benchmarks/dispatch.py --device "$device" 2>&1 | tee "$out/dispatch.txt"
echo "logs in $out"
