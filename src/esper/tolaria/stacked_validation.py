"""The validation half of a stacked host epoch: a group's envs validated as one network.

Why: validation runs one forward per env and batch, with a replica of the batch forked at
each contributing seed (``esper.tolaria.counterfactual``). With training stacked, that
per-env validation became the largest share of a host epoch's kernel launches (16 envs,
the side_by_side work: 724 of 1559), and on a launch-bound GPU launches are the cost.
Envs that train as one group (:func:`~esper.tolaria.stacked.stack_groups`) validate as
one: one mapped evaluation forward per batch, whose template forks a replica at every
seed any member blends in (``StackedGroup.validation_sums``). An env alone validates as
before. The figures equal the per-env validation's up to float rounding, as the stacked
training step's do (``tests/tolaria/test_stacked.py`` compares them), and nothing is read
on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from esper.kasmina.growing_host import GrowingHost
from esper.tolaria.accumulators import EnvAccumulator
from esper.tolaria.counterfactual import validate_with_counterfactuals
from esper.tolaria.stacked import EnvView, StackedGroup, stack_groups


def validate_stacked(
    envs: Sequence[GrowingHost],
    accs: Sequence[EnvAccumulator],
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(val_loss [E], val_acc [E], cf_val_acc [E, S])`` on ``device``, as
    :func:`~esper.tolaria.counterfactual.validate_with_counterfactuals` gives them, with
    the envs that can train as one group validated as one. ``accs``: the envs'
    accumulators of the epoch (a group is built with them; validation does not touch
    them)."""
    batches = list(batches)
    views = [EnvView.of(env) for env in envs]
    groups, alone = stack_groups(envs, views)
    loss: list[Tensor | None] = [None] * len(envs)
    acc: list[Tensor | None] = [None] * len(envs)
    cf: list[Tensor | None] = [None] * len(envs)
    if alone:
        parts = validate_with_counterfactuals([envs[i] for i in alone], batches, device)
        for k, i in enumerate(alone):
            loss[i], acc[i], cf[i] = (part[k] for part in parts)
    for members in groups:
        group = StackedGroup(
            [envs[i] for i in members], [accs[i] for i in members], [views[i] for i in members]
        )
        where = envs[members[0]].device
        on_device = [
            (x.to(where, non_blocking=True), y.to(where, non_blocking=True)) for x, y in batches
        ]
        loss_sum, correct, to_replica, seen = group.validation_sums(on_device)
        if seen == 0:
            raise ValueError("the validation loader yielded no samples; it must not be empty")
        accuracy = (correct / seen).to(device, non_blocking=True)
        losses = (loss_sum[:, 0] / seen).to(device, non_blocking=True)
        # Integer indexing makes views: one stack builds every member's [S] row.
        rows = [accuracy[g, r] for g in range(len(members)) for r in to_replica[g]]
        counterfactual = torch.stack(rows).view(len(members), -1)
        for g, i in enumerate(members):
            loss[i], acc[i], cf[i] = losses[g], accuracy[g, 0], counterfactual[g]
    return torch.stack(loss), torch.stack(acc), torch.stack(cf)  # type: ignore[arg-type]
