"""Kernel-launching operators per PPO update, Esper against esper-lite, on the same work.

Why: where a GPU's host side is the bottleneck (issue 35: an H100 5-12% busy), an update
costs about its launches, and launches are the operators a run issues, which any machine
can count. This runs ``side_by_side.sh``'s work (esper-lite's ``cifar_baseline`` host,
random 3x32x32 images, 1 000 / 200, 16 images per env step, 8-epoch episodes) for both
systems, fits of 1 and ``--updates`` updates, under a dispatch mode that counts every aten
operator that launches a kernel (``launch_rule``: not views, bare allocations, wrapped
scalars, ``set_`` or operators whose outputs are all empty), and prints operators per update = (count of the longer fit - count of the shorter) /
(updates - 1), the formula side_by_side.sh uses for seconds.

Esper runs in this process, with ``--model.engine`` (default ``stacked``, the GPU's engine),
on one intra-op thread: a dispatch mode sees only its own thread, and with one thread the
per-env engine trains its envs in this one, not in worker threads. esper-lite runs in its
own environment (``$PEER_VENV``, built by side_by_side.sh's first run) through
``../shared/peer/run_peer.py``; its other threads are its telemetry workers, and its main
thread is counted.

Usage: ``python benchmarks/operator_counts.py [--n-envs 16] [--updates 3] [--engine stacked]
[--peer-venv PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dispatch import KernelOps
from update_profile import fit_arguments, run_fit

from esper.threads import intra_op_threads

ROOT = Path(__file__).resolve().parents[1]
#: The rule both counts use (``launch_rule``), loaded by path in esper-lite's environment.
LAUNCH_RULE = Path(__file__).resolve().parent / "launch_rule.py"
PEER = ROOT.parent / "shared" / "peer"
DEFAULT_PEER_VENV = Path(tempfile.gettempdir()) / "esper-lite-venv"
#: What the counting wrapper prints last, for the parent to find.
MARK = "OPERATORS"

#: Runs in esper-lite's environment (its ``esper`` package is not ours, so nothing of
#: ours is imported there): argv = [launch_rule.py's path, run_peer.py, its arguments...];
#: the rule is loaded by path, so both systems are counted by the same one.
PEER_COUNTER = """
import importlib.util, runpy, sys
from torch.utils._python_dispatch import TorchDispatchMode
spec = importlib.util.spec_from_file_location("launch_rule", sys.argv[1])
rule = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rule)
class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if rule.launches(func, out):
            Count.n += 1
        return out
script, sys.argv = sys.argv[2], sys.argv[2:]
with Count():
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
print("MARK", Count.n)
""".replace("MARK", MARK)


def esper_operators(n_envs: int, updates: int, engine: str, extra: Sequence[str] = ()) -> int:
    """Operators a fit of ``updates`` issues in this thread (Esper); ``extra`` fit
    arguments go last."""
    with tempfile.TemporaryDirectory() as root, intra_op_threads(1), KernelOps() as ops:
        run_fit([*fit_arguments(n_envs, updates, "cpu", root), "--model.engine", engine, *extra])
    return sum(ops.counts.values())


def peer_operators(
    n_envs: int, updates: int, venv: Path, script: Path = PEER / "run_peer.py"
) -> int:
    """Operators a run of ``updates`` rounds issues in its main thread (esper-lite: its
    launcher ``script`` run by ``venv``'s Python)."""
    with tempfile.TemporaryDirectory() as work:
        config = Path(work) / "lite.json"
        config.write_text(json.dumps({"batch_size_per_env": 16}))
        command = [
            str(venv / "bin" / "python"), "-c", PEER_COUNTER, str(LAUNCH_RULE),
            str(script), "ppo", "--task", "cifar_baseline",
            "--config-json", str(config), "--envs", str(n_envs), "--episode-length", "8",
            "--rounds", str(updates), "--device", "cpu", "--num-workers", "0",
            "--compile-mode", "off", "--no-tui",
        ]  # fmt: skip
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, check=False)
    counts = [line.split()[1] for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not counts:
        raise RuntimeError(f"esper-lite failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return int(counts[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-envs", type=int, default=16)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--engine", default="stacked", help="Esper's --model.engine")
    parser.add_argument(
        "--peer-venv",
        type=Path,
        default=Path(os.environ.get("PEER_VENV", DEFAULT_PEER_VENV)),
        help="esper-lite's environment (side_by_side.sh builds it; default $PEER_VENV)",
    )
    args = parser.parse_args()
    if args.updates < 2:
        parser.error("--updates must be >= 2 (an update's count is a difference of fits)")
    if not (args.peer_venv / "bin" / "python").exists():
        parser.error(
            f"no esper-lite environment at {args.peer_venv}: run "
            "../shared/peer/side_by_side.sh once (it builds one), or pass --peer-venv"
        )
    rows = []
    for system, count in (
        ("esper", lambda n: esper_operators(args.n_envs, n, args.engine)),
        ("esper-lite", lambda n: peer_operators(args.n_envs, n, args.peer_venv)),
    ):
        short, long = count(1), count(args.updates)
        rows.append((system, short, long, (long - short) / (args.updates - 1)))
        print(f"{system}: {rows[-1][3]:.0f} operators an update", file=sys.stderr)
    print(f"\n{args.n_envs} envs, fits of 1 and {args.updates} updates (Esper: {args.engine})")
    print("| system | fit of 1 | fit of N | operators / update |\n|---|---:|---:|---:|")
    for system, short, long, per_update in rows:
        print(f"| {system} | {short} | {long} | {per_update:.0f} |")
    print(f"\nesper-lite / Esper: {rows[1][3] / rows[0][3]:.2f}x the operators an update")


if __name__ == "__main__":
    main()
