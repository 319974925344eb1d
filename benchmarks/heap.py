"""The C heap's freed memory kept by a fit (``KeepFreedMemory``, the default) or handed
back to the kernel as glibc does by itself: side_by_side.sh's Esper fit both ways,
interleaved.

glibc's settings belong to a process, so every fit runs in its own: ``python -m esper
fit`` with side_by_side.sh's arguments (``update_profile.fit_arguments``), the arguments
after ``--`` last. *kept* runs with no malloc variables in its environment, so the fit's
callback raises glibc's thresholds (``esper.heap``); *glibc's own* sets
``GLIBC_TUNABLES=glibc.malloc.check=0`` (glibc's default, a no-op), which the callback
takes for a user's own tuning and leaves alone. Per round and variant, a fit of 1 update
and one of ``--updates``: seconds per update = (wall of N - wall of 1) / (N - 1); page
faults per update the same difference of the child's minor faults (``os.wait4``); and
the longer fit's peak resident memory.

Usage: ``python benchmarks/heap.py [--n-envs 4] [--updates 3] [--rounds 5] [-- FIT ARGS]``
(about 40 s a round at the defaults on a 2-core CPU; run it alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from update_profile import fit_arguments

#: What each variant adds to a fit's environment.
VARIANTS: dict[str, dict[str, str]] = {
    "kept": {},
    "glibc's own": {"GLIBC_TUNABLES": "glibc.malloc.check=0"},
}
#: Taken out of every fit's environment: each variant sets glibc's malloc its own way,
#: and torch picks its thread count as side_by_side.sh lets it.
CLEARED = (
    "GLIBC_TUNABLES",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "OMP_NUM_THREADS",
)


class Run(NamedTuple):
    """One child process, measured from outside it."""

    wall_s: float
    minor_faults: int
    max_rss_mb: float


def environment(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(VARIANTS[variant])
    return env


def run_child(command: list[str], env: dict[str, str]) -> Run:
    """``command`` to its end; its wall, minor page faults and peak resident memory."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert child.stderr is not None
    errors = child.stderr.read()  # read before waiting: a full pipe would block the child
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        tail = errors.decode(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({child.returncode}):\n{tail}")
    return Run(wall, usage.ru_minflt, usage.ru_maxrss / 1024)


def fit_command(n_envs: int, updates: int, root: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "esper", *fit_arguments(n_envs, updates, "cpu", root), *extra]


class PerUpdate(NamedTuple):
    seconds: float
    faults: float
    max_rss_mb: float


def per_update(short: Run, long: Run, updates: int) -> PerUpdate:
    """What the ``updates - 1`` updates the longer fit adds cost, per update."""
    extra = updates - 1
    return PerUpdate(
        (long.wall_s - short.wall_s) / extra,
        (long.minor_faults - short.minor_faults) / extra,
        long.max_rss_mb,
    )


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-envs", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(own)
    if args.updates < 2:
        parser.error("--updates must be at least 2: an update's cost is a difference of fits")
    rows: dict[str, list[PerUpdate]] = {v: [] for v in VARIANTS}
    print(f"{'round':>5} {'variant':<12} {'s/update':>9} {'faults/update':>14} {'max RSS MB':>11}")
    with tempfile.TemporaryDirectory() as root:
        for r in range(1, args.rounds + 1):
            for variant in VARIANTS:
                env = environment(variant)
                runs = [
                    run_child(
                        fit_command(args.n_envs, n, f"{root}/{r}{n}{len(variant)}", extra), env
                    )
                    for n in (1, args.updates)
                ]
                row = per_update(*runs, args.updates)
                rows[variant].append(row)
                print(
                    f"{r:>5} {variant:<12} {row.seconds:>9.3f} {row.faults:>14.0f} "
                    f"{row.max_rss_mb:>11.0f}",
                    flush=True,
                )
    kept, glibc = rows["kept"], rows["glibc's own"]
    differences = [k.seconds - g.seconds for k, g in zip(kept, glibc, strict=True)]
    print(
        f"medians: kept {statistics.median(r.seconds for r in kept):.3f} s/update, "
        f"{statistics.median(r.faults for r in kept):.0f} faults/update; glibc's own "
        f"{statistics.median(r.seconds for r in glibc):.3f} s/update, "
        f"{statistics.median(r.faults for r in glibc):.0f} faults/update"
    )
    print(
        f"kept - glibc's own, round by round: median {statistics.median(differences):+.3f} s/update "
        f"({sum(d < 0 for d in differences)} of {len(differences)} rounds faster kept); "
        f"peak RSS {max(r.max_rss_mb for r in kept):.0f} MB kept, "
        f"{max(r.max_rss_mb for r in glibc):.0f} MB glibc's own"
    )


if __name__ == "__main__":
    main()
