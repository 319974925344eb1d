"""A host's tensors read once for the grouping: what each slot's seed and gate hold, as
the modules themselves list them."""

from __future__ import annotations

import pytest
from torch import Tensor, nn

from esper.contracts import BlendMode, SeedStage
from esper.tolaria.host_tensors import HostTensors
from tests.tolaria.grown import planted

#: A seed of each kind in each stage a step treats differently, gated and not.
PLANS = [
    [("stage0", "conv_light", BlendMode.GATED, SeedStage.BLENDING)],
    [("stage0", "widen", BlendMode.LINEAR, SeedStage.TRAINING)],
    [
        ("stage0", "norm", BlendMode.GATED, SeedStage.GERMINATED),
        ("stage1", "conv_heavy", BlendMode.GATED, SeedStage.HOLDING),
    ],
    [("stage1", "bottleneck", BlendMode.GATED, SeedStage.FOSSILIZED)],
    [],
]


def _listed(module: nn.Module | None) -> tuple[list[tuple[str, Tensor]], ...]:
    if module is None:
        return [], []
    return list(module.named_parameters()), list(module.named_buffers())


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: "+".join(s[1] for s in plan) or "none")
def test_a_hosts_read_tensors_are_each_slots_seed_and_gate_tensors_in_module_order(
    plan: list,
) -> None:
    (env,) = planted([plan])
    read = HostTensors.of(env.model)
    assert list(read.slots) == list(env.model.slot_ids)
    for slot in env.model.iter_slots():
        mine = read.slots[slot.slot_id]
        for got, module in ((mine.seed, slot.seed), (mine.gate, slot.gate)):
            params, buffers = _listed(module)
            assert [(n, id(t)) for n, t in got[0].items()] == [(n, id(t)) for n, t in params]
            assert [(n, id(t)) for n, t in got[1].items()] == [(n, id(t)) for n, t in buffers]
        assert [id(p) for p in mine.seed_parameters()] == [id(p) for p in slot.seed_parameters()]
    named = dict(env.model.named_parameters()), dict(env.model.named_buffers())
    assert read.named == named
