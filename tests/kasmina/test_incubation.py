"""Seeds in TRAINING learn in their own pass, as a fitted residual, without touching the host."""

from __future__ import annotations

import copy

import pytest
import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import GrowingHost, OptimConfig
from esper.kasmina.incubation import incubating_slots, incubation_loss
from esper.kasmina.lifecycle import GateSignals
from tests.kasmina.factories import FAST, forward_backward, make_batch, make_host, train_backward

#: Blueprints with their own normalisation, so the buffer rules are exercised too.
BLUEPRINT = {"cnn": "conv_heavy", "transformer": "mlp"}


def _training_host(kind: str) -> tuple[GrowingHost, str]:
    grown = GrowingHost(make_host(kind, lifecycle=FAST), OptimConfig(seed_lr=0.1))
    slot_id = grown.slot_ids[0]
    grown.germinate(slot_id, BLUEPRINT[kind], BlendMode.LINEAR)
    assert grown.advance(slot_id, GateSignals())  # GERMINATED -> TRAINING
    return grown, slot_id


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_host_gradients_and_buffers_are_those_of_the_host_alone(kind: str) -> None:
    grown, _ = _training_host(kind)
    alone = make_host(kind, lifecycle=FAST)  # same seed: same initial weights
    x, y = make_batch(alone)

    train_backward(grown.model, x, y)
    forward_backward(alone, x, y)

    mine = dict(grown.model.named_parameters())
    for name, p in alone.named_parameters():
        assert torch.equal(mine[name].grad, p.grad), name
    grown_buffers = dict(grown.model.named_buffers())
    for name, b in alone.named_buffers():
        assert torch.equal(grown_buffers[name], b), name


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_incubation_reaches_only_the_training_seeds(kind: str) -> None:
    grown, slot_id = _training_host(kind)
    x, y = make_batch(grown.model)
    slots = incubating_slots(grown.model)
    assert [s.slot_id for s in slots] == [slot_id]

    incubation_loss(grown.model, slots, x, y).backward()

    seed_ids = {id(p) for p in grown.model.slot(slot_id).seed_parameters()}
    for name, p in grown.model.named_parameters():
        if id(p) in seed_ids:
            continue
        assert p.grad is None, f"the incubation pass sent a gradient to host parameter {name}"
    assert any(
        p.grad is not None and bool(p.grad.abs().sum() > 0)
        for p in grown.model.slot(slot_id).seed_parameters()
    )
    assert not grown.model.slot(slot_id).incubating, "the slot must leave incubation mode"


def test_a_training_slot_passes_its_input_through_outside_incubation() -> None:
    grown, slot_id = _training_host("cnn")
    x, _ = make_batch(grown.model)
    alone = make_host("cnn", lifecycle=FAST)
    grown.model.train()
    alone.train()
    assert torch.equal(grown.model(x), alone(x))
    assert grown.model.slot(slot_id).stage is SeedStage.TRAINING


def test_incubated_seed_lowers_the_loss_it_will_be_blended_into() -> None:
    """A fitted residual: after incubation steps, adding the seed at alpha 1 helps."""
    grown, slot_id = _training_host("cnn")
    x, y = make_batch(grown.model, n=32)
    slots = incubating_slots(grown.model)
    before = float(incubation_loss(grown.model, slots, x, y).detach())
    optimizer = grown.seed_optimizers[slot_id]
    for _ in range(20):
        optimizer.zero_grad()
        incubation_loss(grown.model, slots, x, y).backward()
        optimizer.step()
    host_alone = copy.deepcopy(grown.model)
    with torch.no_grad():
        grown.model.train()
        host_loss, _, _ = host_alone.loss_and_correct(host_alone(x), y)
        seeded = float(incubation_loss(grown.model, slots, x, y))
    assert seeded < before
    assert seeded < float(host_loss)
