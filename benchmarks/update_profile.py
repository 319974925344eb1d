"""Where a fit's PPO update spends its seconds: ``esper fit`` under cProfile, by phase.

Why: on an H100 (issue 35, benchmarks/README.md) Esper took 3.2 s an update at 16 envs on
side_by_side's work, where ``benchmarks/gpu.py`` says its host training is a fraction of
that; the rest had no measurement. This runs that work (``side_by_side.sh``'s Esper
command: esper-lite's ``cifar_baseline`` host, random 3x32x32 images, 1 000 / 200, 16
images per env step, 8-epoch episodes) in this process: first an unprofiled fit of one
update (imports, CUDA's start, first kernels), then a profiled fit of ``--updates``. It
prints that fit's seconds per update, each phase's seconds per update (the cumulative
time of the functions in :data:`PHASES`; nested phases are indented and counted in their
parents) and the functions with the most time of their own.

On CUDA the host waits for the device at the step's one read (``read_packed``) and a few
others (the PPO update's early-stop read, checkpoints): time there is the GPU's work not
yet done, time elsewhere is the CPU's (launches and Python). cProfile's own cost inflates
Python-heavy phases; compare phases, not totals, with an unprofiled run. It sees the main
thread only: on a CPU the per-env engine trains and validates in worker threads, which
show as ``run_epoch`` waiting for them.

Usage: ``python benchmarks/update_profile.py [--device cuda] [--n-envs 16] [--updates 3]
[--top 15] [-- MORE FIT ARGUMENTS]`` (a CPU runs it with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence

from esper import cli

#: Phases of an update: label -> (a path ending of the file, the function's name).
PHASES: dict[str, tuple[str, str]] = {
    "update (training_step)": ("esper/simic/module.py", "training_step"),
    "  rollout": ("esper/mdp/rollout.py", "collect"),
    "    host epochs (run_epoch)": ("esper/tolaria/epoch.py", "run_epoch"),
    "      stacked steps": ("esper/tolaria/stacked.py", "step"),
    "      stacked validation": ("esper/tolaria/stacked_validation.py", "validate_stacked"),
    "      per-env validation": (
        "esper/tolaria/counterfactual.py",
        "validate_with_counterfactuals",
    ),
    "    observe": ("esper/mdp/env.py", "observe"),
    "    policy act": ("esper/tamiyo/policy.py", "act"),
    "    the step's read (waits for the device)": ("esper/mdp/step_read.py", "read_packed"),
    "    governor": ("esper/mdp/governor.py", "steer"),
    "    lifecycle (apply)": ("esper/mdp/env.py", "apply"),
    "    buffer add": ("esper/simic/buffer.py", "add"),
    "    pricing (close)": ("esper/mdp/rollout.py", "_close"),
    "  PPO update": ("esper/simic/ppo.py", "ppo_update"),
    "checkpoint save": ("esper/callbacks/checkpoint.py", "save_checkpoint"),
}


def fit_arguments(n_envs: int, updates: int, device: str, root: str) -> list[str]:
    """``side_by_side.sh``'s Esper command for ``n_envs`` and ``updates``."""
    return [
        "fit", "--seed_everything", "0", "--data", "synthetic",
        "--data.input_shape", "[3,32,32]", "--data.n_classes", "10",
        "--data.n_train", "1000", "--data.n_val", "200",
        "--data.batch_size", str(16 * n_envs), "--data.val_batch_size", "200",
        "--model.host_kwargs", '{"channels":[8,16,32],"convs_per_stage":1}',
        "--model.n_envs", str(n_envs), "--model.episode_epochs", "8",
        "--model.ppo.paired_envs", "false", "--model.ppo.critic_baseline", "true",
        "--model.ppo.vf_coef", "0.5",
        "--trainer.accelerator", "gpu" if device == "cuda" else "cpu",
        "--trainer.max_epochs", str(updates), "--trainer.default_root_dir", root,
    ]  # fmt: skip


def run_fit(arguments: Sequence[str]) -> None:
    """``esper fit`` with ``arguments``, in this process, its printed lines kept back (shown
    if it fails); this script's own arguments are hidden from the CLI, which reads them."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            cli.main(list(arguments))
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            print(printed.getvalue())
            raise RuntimeError(f"esper fit failed (exit {exit_.code})") from None
    finally:
        sys.argv = argv


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    """Each phase's cumulative seconds (0 where the function never ran)."""
    found = dict.fromkeys(PHASES, 0.0)
    for (path, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        for label, (ending, function) in PHASES.items():
            if name == function and path.endswith(ending):
                found[label] += row[3]  # cumulative time
    return found


def own_time(stats: pstats.Stats, top: int) -> list[tuple[float, str]]:
    """The ``top`` functions by time of their own (tottime), as (seconds, where)."""
    rows = [
        (row[2], f"{path.split('site-packages/')[-1].split('src/')[-1]}:{line}({name})")
        for (path, line, name), row in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ours, extra = (sys.argv[1:], [])
    if "--" in ours:
        cut = ours.index("--")
        ours, extra = ours[:cut], ours[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--n-envs", type=int, default=16)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(ours)
    if args.updates < 1:
        parser.error("--updates must be >= 1")
    with tempfile.TemporaryDirectory() as root:
        run_fit([*fit_arguments(args.n_envs, 1, args.device, f"{root}/warm"), *extra])
        profile = cProfile.Profile()
        tick = time.perf_counter()
        profile.enable()
        run_fit([*fit_arguments(args.n_envs, args.updates, args.device, root), *extra])
        profile.disable()
        wall = time.perf_counter() - tick
    stats = pstats.Stats(profile)
    print(
        f"\n{args.n_envs} envs on {args.device}, {args.updates} profiled update(s): "
        f"{wall:.2f} s in all (the fit's setup and end included)"
    )
    print(f"{'phase':<48} {'s / update':>10}")
    for label, seconds in phase_seconds(stats).items():
        print(f"{label:<48} {seconds / args.updates:10.3f}")
    print("\nmost time of their own (s / update):")
    for seconds, where in own_time(stats, args.top):
        print(f"{seconds / args.updates:8.3f}  {where}")


if __name__ == "__main__":
    main()
