"""``esper plugins``, ``esper evaluate`` and ``esper report``: the subcommands besides ``fit``.

Each imports what it runs when it runs, so ``esper --help`` stays fast: the registries,
evaluation and plotting pull in torch and Lightning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from esper.cli.bad_input import BAD_INPUT_STATUS, input_error, one_line, try_writing_in

#: Episodes per controller for ``esper evaluate``: enough for a standard error.
DEFAULT_EVAL_EPISODES = 8


def plugins(_: argparse.Namespace) -> int:
    """List each registry's names and where each comes from (built in or a package)."""
    from esper.callbacks import CALLBACKS
    from esper.kasmina import BLUEPRINTS, HOSTS
    from esper.mdp.rewards import REWARDS
    from esper.plugins import Registry
    from esper.tolaria.data import DATAMODULES

    registries: tuple[Registry[object], ...] = (  # type: ignore[assignment]
        BLUEPRINTS,
        HOSTS,
        DATAMODULES,
        REWARDS,
        CALLBACKS,
    )
    width = max((len(name) for r in registries for name in r.names()), default=0)
    for registry in registries:
        print(f"{registry.kind}s (entry-point group {registry.group}):")
        names = registry.names()
        if not names:
            print("  (none)")
        for name in names:
            print(f"  {name:<{width}}  {registry.entry(name).source}")
    return 0


def _say_done(result: Any) -> None:
    """Progress of ``esper evaluate``: one line per controller as it finishes."""
    print(
        f"  {result.controller:<13} {result.episodes} episode(s) in {result.wall_s:.0f} s, "
        f"final test acc {result.test.mean:.4f}, val acc {result.final_val_acc_mean:.4f}",
        file=sys.stderr,
        flush=True,
    )


def evaluate_command(args: argparse.Namespace) -> int:
    """Compare the learned policy with the other controllers; write the tables and pictures."""
    from esper.callbacks.checkpoint import find_last_checkpoint
    from esper.contracts.config_errors import ConfigError
    from esper.contracts.evaluation import seed_range
    from esper.devices import check_usable, parse_device
    from esper.evaluation.comparison import check_controllers
    from esper.evaluation.evaluate import evaluate
    from esper.report.tradeoff import TRADEOFF_FILE, render_accuracy_vs_flops

    controllers = tuple(c.strip() for c in args.controllers.split(",") if c.strip())
    checks = (
        ("--seed", lambda: seed_range(args.seed)),
        ("--controllers/--grower", lambda: check_controllers(controllers, args.grower)),
    )
    if args.episodes < 1:
        print(
            f"esper evaluate: error: --episodes must be >= 1, got {args.episodes}", file=sys.stderr
        )
        return BAD_INPUT_STATUS
    for option, check in checks:
        try:
            check()
        except ValueError as exc:
            print(f"esper evaluate: error: {option}: {one_line(exc)}", file=sys.stderr)
            return BAD_INPUT_STATUS
    try:
        check_usable(parse_device(args.device, "--device"), "--device")
    except ConfigError as exc:
        print(f"esper evaluate: error: {one_line(exc)}", file=sys.stderr)
        return BAD_INPUT_STATUS
    ckpt = Path(args.ckpt)
    if args.ckpt == "last":
        found = find_last_checkpoint(Path("."))
        if found is None:
            print(
                "esper evaluate: error: --ckpt last: no run under this folder has a last.ckpt "
                "(looked in */*/checkpoints and checkpoints); pass the .ckpt path",
                file=sys.stderr,
            )
            return BAD_INPUT_STATUS
        ckpt = found
    out = Path(args.out) if args.out else ckpt.resolve().parent.parent / "evaluation"
    try:
        try_writing_in(out)
    except OSError as exc:
        print(
            f"esper evaluate: error: --out: cannot write the results in {out}: "
            f"{exc.strerror or exc}; pass --out a folder you can write",
            file=sys.stderr,
        )
        return BAD_INPUT_STATUS
    done: list[str] = []

    def say_done(result: Any) -> None:
        done.append(result.controller)
        _say_done(result)

    try:
        result = evaluate(
            ckpt,
            episodes=args.episodes,
            seed=args.seed,
            device=args.device,
            controllers=controllers,
            sample=args.sample,
            on_controller_done=say_done,
            grower=args.grower,
        )
    except KeyboardInterrupt:
        from esper.cli.lightning_cli import INTERRUPTED_STATUS

        print(
            f"esper evaluate: interrupted with {len(done)} of {len(controllers)} controllers "
            "done (their lines above); nothing written: the table compares every controller "
            "on the same episodes. The same command runs them again (the same seed, the same "
            "episodes); --controllers runs fewer",
            file=sys.stderr,
        )
        return INTERRUPTED_STATUS
    except Exception as exc:
        error = input_error(exc)
        if error is None:
            raise
        print(f"esper evaluate: error: {one_line(error, 'evaluate')}", file=sys.stderr)
        return BAD_INPUT_STATUS
    policy = "sampled" if args.sample else "most likely action per head"
    print(
        f"esper evaluate: {args.episodes} episode(s) per controller, evaluation seed "
        f"{args.seed} ({seed_range(args.seed)} range), learned policy {policy}, {ckpt}"
    )
    print(
        f"test accuracy on the test split (never read in training); 95% intervals and "
        f"standard errors count each of the {len(set(result.groups))} episode group(s) once"
    )
    print(result.table())
    written = result.write(out)
    for kind, path in written.items():
        print(f"  {kind:<4} {path}")
    render_accuracy_vs_flops(written["json"], out / TRADEOFF_FILE)
    print(f"  png  {out / TRADEOFF_FILE}")
    timelines = result.write_timelines(out / "timelines")
    print(f"  {len(timelines)} timeline pictures in {out / 'timelines'}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    """Draw the learning curve of every run under ``args.run_dir``."""
    from esper.report import report

    try:
        written = report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"esper report: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
