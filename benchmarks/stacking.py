"""How much of a real fit the stacked engine can stack: env steps trained in a group.

``HostTraining.engine="stacked"`` (``esper.tolaria.stacked``) trains envs whose hosts
share an architecture, seeds, stages and optimizer state as one mapped network; an env
whose seeds differ from every other env's trains alone. ``benchmarks/gpu.py`` times the
best case (fresh, alike hosts). This script runs ``esper fit`` as a user would, with
``--model.engine stacked`` and the arguments given after ``--``, and counts the training
steps that actually ran: each stacked group's step (its size) and each env's own step.
It prints the share of env steps trained in a group, the mean size of the group an env
step ran in, and the steps each batch takes (a step per group and one per env alone: the
sets of launches a GPU would see), whatever split the groups (shares of a batch that
differ in size, running out of memory).

Usage: ``python benchmarks/stacking.py [-- FIT ARGUMENTS]``, e.g.
``python benchmarks/stacking.py -- --model.n_envs 8 --trainer.max_epochs 3``
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from esper import cli
from esper.kasmina.growing_host import GrowingHost
from esper.tolaria import epoch as epoch_module
from esper.tolaria import stacked


def count_groups(fit_arguments: Sequence[str]) -> dict[str, float]:
    """Run the fit with the stacked engine; tally every training step it ran."""
    tally: collections.Counter[str] = collections.Counter()
    real_train_batches = epoch_module._train_batches
    real_step = stacked.StackedGroup.step
    real_train_step = epoch_module._train_step

    def counted_epoch(
        envs: Sequence[GrowingHost], accs: Any, batches: Iterable[Any], *rest: Any
    ) -> Any:
        tally["epochs"] += 1
        tally["env_epochs"] += len(envs)

        def counted_batches() -> Iterator[Any]:
            for batch in batches:
                tally["batches"] += 1
                yield batch

        return real_train_batches(envs, accs, counted_batches(), *rest)

    def counted_step(self: stacked.StackedGroup, *args: Any, **kwargs: Any) -> None:
        real_step(self, *args, **kwargs)
        tally["group_steps"] += 1
        tally["stacked_env_steps"] += self.size
        tally["group_size_sum"] += self.size**2  # each member's group size

    def counted_train_step(*args: Any, **kwargs: Any) -> None:
        real_train_step(*args, **kwargs)
        tally["lone_steps"] += 1

    epoch_module._train_batches = counted_epoch  # type: ignore[assignment]
    stacked.StackedGroup.step = counted_step  # type: ignore[method-assign]
    epoch_module._train_step = counted_train_step  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as root:
            argv = ["fit", "--model.engine", "stacked", "--trainer.default_root_dir", root]
            code = cli.main([*argv, *fit_arguments])
    finally:
        epoch_module._train_batches = real_train_batches  # type: ignore[assignment]
        stacked.StackedGroup.step = real_step  # type: ignore[method-assign]
        epoch_module._train_step = real_train_step  # type: ignore[assignment]
    if code != 0:
        raise SystemExit(f"esper fit exited {code}")
    env_steps = tally["stacked_env_steps"] + tally["lone_steps"]
    return {
        "host_epochs": tally["epochs"],
        "env_epochs": tally["env_epochs"],
        "env_steps": env_steps,
        "stacked_share": tally["stacked_env_steps"] / max(env_steps, 1),
        "mean_group": tally["group_size_sum"] / max(tally["stacked_env_steps"], 1),
        "steps_per_batch": (tally["group_steps"] + tally["lone_steps"]) / max(tally["batches"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fit_arguments", nargs="*", help="after --: passed to esper fit")
    args = parser.parse_args()
    result = count_groups(args.fit_arguments)
    print()
    print(f"esper fit --model.engine stacked {' '.join(args.fit_arguments)}")
    print(
        "| host epochs | env epochs | env steps | trained in a group | mean group size "
        "| steps per batch |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {result['host_epochs']} | {result['env_epochs']} | {result['env_steps']} | "
        f"{result['stacked_share']:.1%} | {result['mean_group']:.2f} | "
        f"{result['steps_per_batch']:.2f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
