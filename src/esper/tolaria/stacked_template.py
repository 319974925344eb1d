"""The model a stacked group runs its forward with when no member runs every seed.

A group (``esper.tolaria.stacked.StackedGroup``) runs one forward for all its members. Where
one member's host runs every seed and gate any member runs, that host's structure serves
(``esper.tolaria.stacked_plan.GroupPlan``); where none does (one blends a seed in at one
slot, another at another), the group builds one here from the members' slots, with
placeholder tensors: the group swaps its stacked tensors in, and the forward reads no other.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.tolaria.stack_grouping import BLEND_STAGES, GATE_STAGES, IDLE_STAGES
from esper.tolaria.structure_copy import deepcopy_structure


def built_template(
    envs: Sequence[GrowingHost], signatures: Sequence[dict[str, Hashable]]
) -> tuple[HostModel, dict[str, GrowingHost]]:
    """A host that runs every seed a group's members run, where no member does (one blends
    a seed in at one slot, another at another), and the member each slot came from.

    A copy of the member with the most entries of
    :func:`esper.tolaria.stack_grouping.optional_signature`, each slot taken from the
    member that runs the most there: one blending a seed in before one incubating it, one
    whose gate the forward runs before one without (a fossilized seed with a gate beside
    one without shares a key). The forward runs each seed as the member it came from
    would. Its own tensors are uninitialised (:func:`placeholders`):
    the group's stacked tensors are swapped in, and the forward runs no other."""
    base = max(range(len(envs)), key=lambda g: (len(signatures[g]), -g))
    template = deepcopy_structure(envs[base].model, placeholders(envs[base].model))
    owners = {slot_id: envs[base] for slot_id in template.slot_ids}
    for slot_id in template.slot_ids:
        running = [
            (slot.stage in BLEND_STAGES, slot.gate is not None and slot.stage in GATE_STAGES, -g)
            for g, env in enumerate(envs)
            if (slot := env.model.slot(slot_id)).seed is not None and slot.stage not in IDLE_STAGES
        ]
        if not running:
            continue
        donor = -max(running)[2]
        if donor != base:
            slot = envs[donor].model.slot(slot_id)
            template.slots[slot_id] = deepcopy_structure(slot, placeholders(slot))
            owners[slot_id] = envs[donor]
    return template, owners


def placeholders(module: nn.Module) -> dict[int, object]:
    """A ``copy.deepcopy`` memo that gives each parameter and buffer of ``module`` an
    uninitialised tensor of its shape, dtype and device instead of a copy of its values: a
    built template's own tensors are never read, and copying them cost a kernel each."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b)
    return memo
