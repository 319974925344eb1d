"""The ``esper`` command.

``esper fit`` trains the growth policy with Lightning's CLI: ``--config FILE``, dotted
overrides (``--model.n_envs 8``, ``--trainer.max_epochs 20``, ``--data.batch_size 64``) and
``--print_config`` work as LightningCLI users expect. With no arguments it trains on the
embedded digits data and prints a summary of the last rollout.

``esper plugins`` lists what the registries hold after loading entry points: a plugin
author's first check that their package is seen, and where each name comes from.
``esper evaluate`` compares controllers on a checkpoint; ``esper report`` draws a run's
learning curve.

Where each part lives: ``lightning_cli`` (``esper fit``: the LightningCLI subclass),
``options`` (its parser's defaults and shortcuts), ``resume`` (``--ckpt_path``),
``bad_input`` (one line naming the bad value instead of a traceback), ``summary`` (what a
run prints when it ends) and ``commands`` (the other subcommands).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from esper import __version__
from esper.cli.commands import DEFAULT_EVAL_EPISODES, evaluate_command, plugins, report_command
from esper.cli.options import data_names_as_class_paths
from esper.contracts.evaluation import (
    ALL_CONTROLLERS,
    DEFAULT_CONTROLLERS,
    DEFAULT_GROWER,
    REPORTING_SEEDS,
    TUNING_SEEDS,
    span,
)

__all__ = ["build_parser", "fit", "main"]


def fit(argv: Sequence[str] | None = None) -> int:
    """``esper fit`` (:func:`esper.cli.lightning_cli.fit`), imported when it runs: Lightning
    takes about 3 s to import, which ``esper --help`` and the other commands need not pay."""
    from esper.cli.lightning_cli import fit as run_fit

    return run_fit(argv)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but ``fit``, which LightningCLI parses itself."""
    parser = argparse.ArgumentParser(
        prog="esper", description="Train networks that grow, steered by a PPO policy."
    )
    parser.add_argument("--version", action="version", version=f"esper {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser(
        "plugins", help="list blueprints, hosts, data, rewards and callbacks"
    )
    listing.set_defaults(run=plugins)
    commands.add_parser(
        "fit", help="train the growth policy (LightningCLI; `esper fit --help` for options)"
    )
    ev = commands.add_parser(
        "evaluate",
        help="compare the learned policy with static networks, a fixed schedule, random "
        "growth and no growth, on the test split",
    )
    ev.add_argument(
        "--ckpt",
        required=True,
        help="a checkpoint written by esper fit, or `last`: the newest run's last.ckpt "
        "under the current folder",
    )
    ev.add_argument("--episodes", type=int, default=DEFAULT_EVAL_EPISODES)
    ev.add_argument(
        "--seed",
        type=int,
        default=TUNING_SEEDS.start,
        help=f"evaluation seed, never used in training; no two seeds share an episode. "
        f"Tune on {span(TUNING_SEEDS)}, report on {span(REPORTING_SEEDS)} "
        "(default: %(default)s)",
    )
    ev.add_argument(
        "--controllers",
        default=",".join(DEFAULT_CONTROLLERS),
        help=f"comma-separated, from {','.join(ALL_CONTROLLERS)} (default: %(default)s)",
    )
    ev.add_argument(
        "--grower",
        default=DEFAULT_GROWER,
        help="the grower whose final networks static_final and static_equal copy "
        "(default: %(default)s)",
    )
    ev.add_argument("--device", default="cpu")
    ev.add_argument(
        "--sample",
        action="store_true",
        help="draw the learned policy's actions from its distribution (as in training) "
        "instead of taking each head's most likely choice",
    )
    ev.add_argument("--out", default=None, help="output folder (default: <run dir>/evaluation)")
    ev.set_defaults(run=evaluate_command)
    rep = commands.add_parser(
        "report", help="draw learning_curve.png beside each events.jsonl under a run directory"
    )
    rep.add_argument("run_dir", type=Path, help="the run's folder (e.g. its default_root_dir)")
    rep.set_defaults(run=report_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "fit":
        if argv is not None:
            return fit(data_names_as_class_paths(words[1:]))
        # From the console LightningCLI reads sys.argv itself ("fit" is its subcommand).
        sys.argv[2:] = data_names_as_class_paths(words[1:])
        return fit(None)
    args = build_parser().parse_args(words)
    return int(args.run(args))
