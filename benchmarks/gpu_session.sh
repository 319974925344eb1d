#!/usr/bin/env bash
# Issue 35's GPU checks as one device call: benchmarks/launch_strategies.py (the ways an
# engine could launch, in plain PyTorch: the figures that choose it), the CUDA tests,
# benchmarks/gpu.py for both engines (fresh hosts, then grown apart as in a fit), then
# benchmarks/dispatch.py on CUDA (fresh and grown hosts). Written for
# the `device` tool's machines (torch, lightning, pytest and hypothesis installed there;
# no network), where it runs from the repository root as
#   bash benchmarks/gpu_session.sh            (figures and logs land in $OUT)
# ESPER_GPU_ENVS / ESPER_GPU_EPOCHS shrink gpu.py (default "4 16 64" and 2),
# ESPER_LAUNCH_ENVS launch_strategies.py (default "16 64"), ESPER_GROWN_ENVS gpu.py on grown
# hosts (default 16); PYTHON names the interpreter
# (default python3); ESPER_GPU_DEVICE=cpu tries it on a CPU.
# Esper runs from src/ with the machine's torch (no install: the pinned CPU torch is not
# what a GPU wants, and GAE falls back to tensor ops without its C kernel).
set -u -o pipefail
out=${OUT:-$(mktemp -d)}
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
envs=${ESPER_GPU_ENVS:-4 16 64}
epochs=${ESPER_GPU_EPOCHS:-2}
launch_envs=${ESPER_LAUNCH_ENVS:-16 64}
grown_envs=${ESPER_GROWN_ENVS:-16}
py=${PYTHON:-python3}
device=${ESPER_GPU_DEVICE:-cuda}
"$py" - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, {name}, {torch.get_num_threads()} CPU threads")
PY
# Each part under a timeout, so the call ends inside the device's 10-minute limit; the
# most telling part first, and every row is printed as it is measured.
# shellcheck disable=SC2086  # lists of counts
timeout 120 "$py" benchmarks/launch_strategies.py --device "$device" --n-envs $launch_envs 2>&1 \
  | tee "$out/launch_strategies.txt"
# CUDA tests of the host-training paths (stacked vs per-env, streams, AMP, rollout reads)
# and of the policy's fused (cuDNN) replay.
timeout 150 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/tolaria tests/mdp \
  tests/kasmina tests/tamiyo 2>&1 | tee "$out/gpu_tests.txt"
# shellcheck disable=SC2086
timeout 180 "$py" benchmarks/gpu.py --device "$device" --n-envs $envs --epochs "$epochs" 2>&1 \
  | tee "$out/gpu_bench.txt"
# Hosts as different as a fit makes them: what a stacked group running every seed costs.
timeout 45 "$py" benchmarks/gpu.py --device "$device" --n-envs $grown_envs --epochs 1 \
  --hosts predecessor --grown 2>&1 | tee "$out/gpu_bench_grown.txt"
timeout 30 "$py" benchmarks/dispatch.py --device "$device" 2>&1 | tee "$out/dispatch.txt"
timeout 30 "$py" benchmarks/dispatch.py --device "$device" --grown 2>&1 \
  | tee "$out/dispatch_grown.txt"
echo "logs in $out"
