"""How much of a real fit the stacked engine can stack: env epochs trained in a group.

``HostTraining.engine="stacked"`` (``esper.tolaria.stacked``) trains envs whose hosts
share an architecture, seeds, stages and optimizer state as one mapped network; an env
whose seeds differ from every other env's trains alone. ``benchmarks/gpu.py`` times the
best case (fresh, alike hosts). This script runs ``esper fit`` as a user would, with
``--model.engine stacked`` and the arguments given after ``--``, and counts, at every
host epoch, how the envs fell into groups: the share of env epochs trained in a group,
the mean size of the group an env trained in, and the steps each batch takes (a step
per group and one per env alone: the sets of launches a GPU would see; a batch whose
shares differ in size trains its groups env by env, which this does not count).

Usage: ``python benchmarks/stacking.py [-- FIT ARGUMENTS]``, e.g.
``python benchmarks/stacking.py -- --model.n_envs 8 --trainer.max_epochs 3``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence

from esper import cli
from esper.kasmina.growing_host import GrowingHost
from esper.tolaria import epoch as epoch_module
from esper.tolaria import stacked


def count_groups(fit_arguments: Sequence[str]) -> dict[str, float]:
    """Run the fit with the stacked engine; tally every host epoch's grouping."""
    tally = {"epochs": 0, "env_epochs": 0, "stacked_env_epochs": 0, "group_size_sum": 0}
    tally["steps"] = 0  # per batch: one per group, one per env alone
    real_stack_groups = stacked.stack_groups

    def counted(
        envs: Sequence[GrowingHost], views: Sequence[stacked.EnvView] | None = None
    ) -> tuple[list[list[int]], list[int]]:
        groups, alone = real_stack_groups(envs, views)
        tally["epochs"] += 1
        tally["env_epochs"] += len(envs)
        tally["steps"] += len(groups) + len(alone)
        for group in groups:
            tally["stacked_env_epochs"] += len(group)
            tally["group_size_sum"] += len(group) ** 2  # each member's group size
        return groups, alone

    epoch_module.stack_groups = counted  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as root:
            argv = ["fit", "--model.engine", "stacked", "--trainer.default_root_dir", root]
            code = cli.main([*argv, *fit_arguments])
    finally:
        epoch_module.stack_groups = real_stack_groups
    if code != 0:
        raise SystemExit(f"esper fit exited {code}")
    stacked_share = tally["stacked_env_epochs"] / max(tally["env_epochs"], 1)
    mean_group = tally["group_size_sum"] / max(tally["stacked_env_epochs"], 1)
    return {
        "host_epochs": tally["epochs"],
        "env_epochs": tally["env_epochs"],
        "stacked_share": stacked_share,
        "mean_group": mean_group,
        "steps_per_batch": tally["steps"] / max(tally["epochs"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fit_arguments", nargs="*", help="after --: passed to esper fit")
    args = parser.parse_args()
    result = count_groups(args.fit_arguments)
    print()
    print(f"esper fit --model.engine stacked {' '.join(args.fit_arguments)}")
    print("| host epochs | env epochs | trained in a group | mean group size | steps per batch |")
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {result['host_epochs']} | {result['env_epochs']} | "
        f"{result['stacked_share']:.1%} | {result['mean_group']:.2f} | "
        f"{result['steps_per_batch']:.2f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
