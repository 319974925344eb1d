"""The validation half of a stacked host epoch: a group's envs validated as one network.

Why: validation runs one forward per env and batch, with a replica of the batch forked at
each contributing seed (``esper.tolaria.counterfactual``). With training stacked, that
per-env validation became the largest share of a host epoch's kernel launches (16 envs,
the side_by_side work: 724 of 1559), and on a launch-bound GPU launches are the cost.
The groups that trained an epoch through validate as one, from the stacked tensors they
hold before they are written back: one mapped evaluation forward per batch, whose
template forks a replica at every seed any member blends in
(``StackedGroup.validation_sums``). Every other env validates as before. The figures equal the per-env validation's up to float rounding, as the stacked
training step's do (``tests/tolaria/test_stacked.py`` compares them), and nothing is read
on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from esper.kasmina.growing_host import GrowingHost
from esper.tolaria.counterfactual import validate_with_counterfactuals
from esper.tolaria.stacked import StackedGroup


def validate_stacked(
    envs: Sequence[GrowingHost],
    groups: Sequence[StackedGroup],
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(val_loss [E], val_acc [E], cf_val_acc [E, S])`` on ``device``, as
    :func:`~esper.tolaria.counterfactual.validate_with_counterfactuals` gives them, with
    the members of each of ``groups`` (groups of ``envs``) validated as one."""
    batches = list(batches)
    index = {id(env): i for i, env in enumerate(envs)}
    grouped = [[index[id(env)] for env in group.envs] for group in groups]
    alone = sorted(set(range(len(envs))).difference(*grouped))
    loss: list[Tensor | None] = [None] * len(envs)
    acc: list[Tensor | None] = [None] * len(envs)
    cf: list[Tensor | None] = [None] * len(envs)
    if alone:
        parts = validate_with_counterfactuals([envs[i] for i in alone], batches, device)
        for k, i in enumerate(alone):
            loss[i], acc[i], cf[i] = (part[k] for part in parts)
    for group, members in zip(groups, grouped, strict=True):
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
