"""Seeds in TRAINING learn in their own pass, as a fitted residual, without touching the host."""

from __future__ import annotations

import copy

import pytest
import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost, HostModel, OptimConfig
from esper.kasmina.incubation import (
    IncubationPass,
    incubating_slots,
    incubation_loss,
    recording_start,
)
from esper.kasmina.lifecycle import GateSignals
from tests.kasmina.factories import FAST, forward_backward, make_batch, make_host, train_backward
from tests.ops import OpCounter

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


def _functional_reference(grown: GrowingHost, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The pass written plainly: ``functional_call`` with every host parameter detached
    and every host buffer cloned."""
    slots = incubating_slots(grown.model)
    seed_params = {id(p) for slot in slots for p in slot.seed_parameters()}
    seed_buffers = {id(b) for slot in slots for b in slot.seed.buffers()}
    tensors = {
        name: p if id(p) in seed_params else p.detach()
        for name, p in grown.model.named_parameters()
    }
    tensors.update(
        {name: b if id(b) in seed_buffers else b.clone() for name, b in grown.model.named_buffers()}
    )
    for slot in slots:
        slot.incubating = True
    try:
        out = torch.func.functional_call(grown.model, tensors, (x,))
    finally:
        for slot in slots:
            slot.incubating = False
    return grown.model.loss_and_correct(out, y)[0]


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_the_pass_equals_a_functional_call_with_the_host_detached(kind: str) -> None:
    """Same loss, bit-identical seed gradients and buffers, over steps of one pass."""
    mine, reference = _incubating_host(kind, [0, 1]), _incubating_host(kind, [0, 1])
    the_pass = IncubationPass(mine.model, incubating_slots(mine.model))
    for step in range(3):  # one pass serves every batch while the stages hold
        x, y = make_batch(mine.model, n=6, seed=step)
        for grown in (mine, reference):
            grown.zero_grad()
        loss = the_pass.loss(x, y)
        expected = _functional_reference(reference, x, y)
        loss.backward()
        expected.backward()
        assert torch.equal(loss, expected)
        assert _seed_grads(mine).keys() == _seed_grads(reference).keys()
        for name, grad in _seed_grads(reference).items():
            assert torch.equal(_seed_grads(mine)[name], grad), name
        for grown in (mine, reference):
            grown.step()
    theirs = dict(reference.model.named_buffers())
    for name, b in mine.model.named_buffers():
        assert torch.equal(b, theirs[name]), name
    assert all(p.requires_grad for p in mine.model.parameters())


def test_a_training_host_s_batch_norms_are_run_without_copies_of_their_statistics() -> None:
    """In training mode a batch norm's running statistics do not enter its output, so the
    pass hands it none (no clone: each is a kernel call on the worker threads' shared
    lock) and they stay untouched; a slot's buffers are only read, and not copied
    either. The seed still learns."""
    grown = _incubating_host("cnn", [0])
    buffers = {n: b.clone() for n, b in grown.model.named_buffers()}
    assert any("running_mean" in n for n in buffers)
    x, y = make_batch(grown.model)
    counter = OpCounter()
    with counter:
        loss = IncubationPass(grown.model, incubating_slots(grown.model)).loss(x, y)
    assert counter.ops["clone"] == 0, counter.ops
    loss.backward()
    for name, b in grown.model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    seed = grown.model.slot(grown.slot_ids[0])
    assert all(p.grad is not None for p in seed.seed_parameters())


def test_an_evaluating_host_s_buffers_are_cloned_and_left_as_they_were() -> None:
    """A batch norm in eval mode normalises by its running statistics: the pass keeps the
    plain rule for it (a clone in, the buffer back) and equals the functional call."""
    mine, reference = _incubating_host("cnn", [0]), _incubating_host("cnn", [0])
    for grown in (mine, reference):
        grown.model.eval()
    buffers = {n: b.clone() for n, b in mine.model.named_buffers()}
    x, y = make_batch(mine.model)
    counter = OpCounter()
    with counter:
        loss = IncubationPass(mine.model, incubating_slots(mine.model)).loss(x, y)
    assert counter.ops["clone"] > 0
    expected = _functional_reference(reference, x, y)
    assert torch.equal(loss, expected)
    for name, b in mine.model.named_buffers():
        assert torch.equal(b, buffers[name]), name


def test_a_forward_that_raises_leaves_the_host_as_it_was() -> None:
    grown = _incubating_host("cnn", [0])
    params = {name: p.requires_grad for name, p in grown.model.named_parameters()}
    buffers = dict(grown.model.named_buffers())
    wrong = torch.zeros(2, 3, 8, 8)  # three channels into a one-channel host
    with pytest.raises(ValueError, match="expects images"):
        IncubationPass(grown.model, incubating_slots(grown.model)).loss(wrong, torch.zeros(2))
    assert {n: p.requires_grad for n, p in grown.model.named_parameters()} == params
    assert all(b is buffers[n] for n, b in grown.model.named_buffers())
    assert not any(slot.incubating for slot in grown.model.iter_slots())


def test_a_training_slot_passes_its_input_through_outside_incubation() -> None:
    grown, slot_id = _training_host("cnn")
    x, _ = make_batch(grown.model)
    alone = make_host("cnn", lifecycle=FAST)
    grown.model.train()
    alone.train()
    assert torch.equal(grown.model(x), alone(x))
    assert grown.model.slot(slot_id).stage is SeedStage.TRAINING


def _learnable_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose label is a rule of the pixels (top half brighter than bottom half), so
    what a seed learns on some of them holds on others."""
    x = torch.randn(n, 1, 8, 8, generator=generator)
    y = (x[:, 0, :4].mean(dim=(1, 2)) > x[:, 0, 4:].mean(dim=(1, 2))).long()
    return x, y


def test_incubated_seed_lowers_the_loss_it_will_be_blended_into() -> None:
    """A fitted residual: after incubation steps on training batches, adding the seed at
    alpha 1 lowers the loss on images it never trained on."""
    grown, slot_id = _training_host("cnn")
    generator = torch.Generator().manual_seed(3)
    train = [_learnable_batch(32, generator) for _ in range(8)]
    held_x, held_y = _learnable_batch(512, generator)
    slots = incubating_slots(grown.model)
    grown.model.train()
    with torch.no_grad():
        before = float(incubation_loss(grown.model, slots, held_x, held_y))
    optimizer = grown.seed_optimizers[slot_id]
    for step in range(40):
        x, y = train[step % len(train)]
        optimizer.zero_grad()
        incubation_loss(grown.model, slots, x, y).backward()
        optimizer.step()
    host_alone = copy.deepcopy(grown.model)
    with torch.no_grad():
        host_loss, _, _ = host_alone.loss_and_correct(host_alone(held_x), held_y)
        seeded = float(incubation_loss(grown.model, slots, held_x, held_y))
    assert seeded < before
    assert seeded < float(host_loss)


def _incubating_host(kind: str, slot_ids: list[int]) -> GrowingHost:
    grown = GrowingHost(make_host(kind, lifecycle=FAST), OptimConfig(seed_lr=0.1))
    for index in slot_ids:
        slot_id = grown.slot_ids[index]
        grown.germinate(slot_id, BLUEPRINT[kind], BlendMode.LINEAR)
        assert grown.advance(slot_id, GateSignals())  # GERMINATED -> TRAINING
    grown.model.train()
    return grown


def _seed_grads(grown: GrowingHost) -> dict[str, torch.Tensor]:
    return {
        f"{slot.slot_id}.{i}": p.grad.clone()
        for slot in incubating_slots(grown.model)
        for i, p in enumerate(slot.seed_parameters())
    }


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
@pytest.mark.parametrize("slots", [[0], [1], [0, 1]], ids=["first", "second", "both"])
def test_a_pass_started_at_the_recorded_slot_input_equals_the_whole_pass(
    kind: str, slots: list[int]
) -> None:
    """The layers before the first incubating slot are skipped, not changed: same loss,
    bit-identical seed gradients, the host's buffers untouched."""
    whole, resumed = _incubating_host(kind, slots), _incubating_host(kind, slots)
    x, y = make_batch(whole.model, n=6)
    incubating = incubating_slots(resumed.model)
    with recording_start(resumed.model, incubating) as start:
        forward_backward(resumed.model, x, y)
    forward_backward(whole.model, x, y)
    assert start is not None and start.index == min(slots)
    assert start.slot_input is not None and not start.slot_input.requires_grad
    buffers = {n: b.clone() for n, b in resumed.model.named_buffers() if "seed" not in n}

    loss_resumed = incubation_loss(resumed.model, incubating, x, y, start)
    loss_whole = incubation_loss(whole.model, incubating_slots(whole.model), x, y)
    loss_resumed.backward()
    loss_whole.backward()

    assert torch.equal(loss_resumed, loss_whole)
    mine, theirs = _seed_grads(resumed), _seed_grads(whole)
    assert mine.keys() == theirs.keys() and mine
    for name, grad in theirs.items():
        assert torch.equal(mine[name], grad), name
    for name, b in resumed.model.named_buffers():
        if name in buffers:
            assert torch.equal(b, buffers[name]), name


def test_recording_removes_its_hook_and_yields_nothing_without_training_seeds() -> None:
    grown = _incubating_host("cnn", [1])
    x, _ = make_batch(grown.model)
    with recording_start(grown.model, []) as nothing:
        grown.model(x)
    assert nothing is None
    slot = grown.model.slot(grown.slot_ids[1])
    with recording_start(grown.model, incubating_slots(grown.model)):
        assert len(slot._forward_pre_hooks) == 1
    assert not slot._forward_pre_hooks


def test_a_host_that_cannot_resume_runs_the_whole_pass() -> None:
    """A host written before ``forward_from_slot`` existed still trains its seeds."""

    class WholeOnly(CNNHost):
        forward_from_slot = HostModel.forward_from_slot

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage, slot, pool in zip(self.stages, self.slots.values(), self.pools, strict=True):
                x = slot(stage(x))
                if pool:
                    x = torch.nn.functional.max_pool2d(x, 2)
            return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    grown = GrowingHost(
        WholeOnly((1, 8, 8), n_classes=10, channels=(16, 32), lifecycle=FAST), OptimConfig()
    )
    grown.germinate(grown.slot_ids[0], "conv_heavy", BlendMode.LINEAR)
    assert grown.advance(grown.slot_ids[0], GateSignals())
    x, y = make_batch(grown.model)
    slots = incubating_slots(grown.model)
    with recording_start(grown.model, slots) as start:
        forward_backward(grown.model, x, y)
    assert start is None
    incubation_loss(grown.model, slots, x, y, start).backward()
    assert all(p.grad is not None for p in slots[0].seed_parameters())


def test_a_start_recorded_on_another_batch_is_refused() -> None:
    grown = _incubating_host("cnn", [0])
    slots = incubating_slots(grown.model)
    x, _ = make_batch(grown.model, n=4)
    with recording_start(grown.model, slots) as start:
        grown.model(x)
    big_x, big_y = make_batch(grown.model, n=8)
    with pytest.raises(ValueError, match="recorded slot input holds 4 samples"):
        incubation_loss(grown.model, slots, big_x, big_y, start)
