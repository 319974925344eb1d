"""A grown host's final architecture: read off at the end, built from scratch, counted alike."""

from __future__ import annotations

import pytest
import torch

from esper.contracts import BlendMode, IllegalTransitionError, SeedStage
from esper.kasmina import CNNHost, GrowingHost
from esper.kasmina.architecture import (
    SlotSeed,
    build_architecture,
    final_architecture,
    final_param_count,
)
from esper.kasmina.lifecycle import GateSignals

CHANNELS = [2, 4, 8]


def _host() -> GrowingHost:
    return GrowingHost(CNNHost((1, 8, 8), 10, channels=CHANNELS))


def _advance_to(host: GrowingHost, slot_id: str, stage: SeedStage) -> None:
    slot = host.model.slot(slot_id)
    while slot.stage is not stage:
        slot.lifecycle.epochs_in_stage = 100  # every clock gate satisfied
        assert host.advance(slot_id, GateSignals(contribution=1.0))


def _grown() -> GrowingHost:
    """Slot 0 fossilized, slot 1 blending (gated), slot 2 still training."""
    torch.manual_seed(0)
    host = _host()
    host.germinate("stage0", "conv_wide", BlendMode.LINEAR)
    _advance_to(host, "stage0", SeedStage.FOSSILIZED)
    host.germinate("stage1", "conv_light", BlendMode.GATED)
    _advance_to(host, "stage1", SeedStage.BLENDING)
    host.germinate("stage2", "conv_heavy", BlendMode.LINEAR)
    _advance_to(host, "stage2", SeedStage.TRAINING)
    return host


def test_the_final_architecture_holds_the_seeds_whose_output_the_host_adds() -> None:
    assert final_architecture(_grown().model) == (
        SlotSeed("conv_wide", BlendMode.LINEAR),
        SlotSeed("conv_light", BlendMode.GATED),
        None,  # a TRAINING seed adds nothing (alpha 0): not part of the final network
    )
    assert final_architecture(_host().model) == (None, None, None)


def test_the_final_parameter_count_leaves_out_seeds_that_add_nothing_yet() -> None:
    host = _grown()
    total = sum(p.numel() for p in host.model.parameters())
    training = host.model.slot("stage2").seed_param_count()
    assert training > 0
    assert final_param_count(host.model) == total - training
    plain = _host().model
    assert final_param_count(plain) == sum(p.numel() for p in plain.parameters())


def test_a_built_architecture_is_the_grown_network_fossilized_from_the_start() -> None:
    grown = _grown()
    architecture = final_architecture(grown.model)
    torch.manual_seed(1)
    model = CNNHost((1, 8, 8), 10, channels=CHANNELS)
    x = torch.randn(3, 1, 8, 8)
    model.eval()
    before = model(x)
    build_architecture(model, architecture, seed_keys=[7, 8, 9])
    assert [s.stage for s in model.iter_slots()] == [
        SeedStage.FOSSILIZED,
        SeedStage.FOSSILIZED,
        SeedStage.DORMANT,
    ]
    assert all(s.alpha == 1.0 for s in list(model.iter_slots())[:2])
    assert model.slot("stage1").gate is not None  # the gated blend's gate comes with it
    assert torch.equal(model(x), before)  # seeds start at zero output, as when germinated
    assert final_param_count(model) == final_param_count(grown.model)
    host = GrowingHost(model)  # every parameter, seeds included, is the host's to train
    trained = {id(p) for g in host.host_optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in model.parameters()}
    assert host.seed_optimizers == {}


def test_seed_keys_fix_the_built_seeds_and_leave_the_global_generator_alone() -> None:
    architecture = (SlotSeed("conv_wide", BlendMode.LINEAR), None, None)
    built = []
    for _ in range(2):
        torch.manual_seed(3)
        model = CNNHost((1, 8, 8), 10, channels=CHANNELS)
        build_architecture(model, architecture, seed_keys=[5, 0, 0])
        built.append((model, torch.rand(1)))
    (a, draw_a), (b, draw_b) = built
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    torch.manual_seed(3)
    CNNHost((1, 8, 8), 10, channels=CHANNELS)
    assert torch.equal(draw_a, torch.rand(1))  # the build drew nothing from the global stream
    assert torch.equal(draw_a, draw_b)


def test_only_a_fresh_slot_is_built_and_the_architecture_must_fit_the_host() -> None:
    host = _host()
    host.germinate("stage0", "conv_wide", BlendMode.LINEAR)
    with pytest.raises(IllegalTransitionError, match="fresh DORMANT slot"):
        host.model.slot("stage0").build_fossilized("conv_wide", BlendMode.LINEAR)
    with pytest.raises(ValueError, match="lists 2 slots but the host has 3"):
        build_architecture(_host().model, (None, None))
