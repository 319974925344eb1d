"""GrowingHost keeps optimizers in step with the module tree (kasmina/growing_host.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from esper.contracts import BlendMode, IllegalTransitionError, SeedStage
from esper.kasmina import GateSignals, GrowingHost, OptimConfig
from tests.kasmina.factories import FAST, forward_backward, make_batch, make_host, train_backward

GOOD = GateSignals(grads_finite=True, contribution=1.0)


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def _optimizer_ids(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in opt.param_groups for p in group["params"]}


def _all_optimizer_ids(grown: GrowingHost) -> set[int]:
    ids = _optimizer_ids(grown.host_optimizer)
    for opt in grown.seed_optimizers.values():
        ids |= _optimizer_ids(opt)
    return ids


def _advance_to(grown: GrowingHost, slot_id: str, stage: SeedStage) -> None:
    slot = grown.model.slot(slot_id)
    for _ in range(20):
        if slot.stage is stage:
            return
        if not grown.advance(slot_id, GOOD):
            grown.end_epoch()
    raise AssertionError(f"stuck in {slot.stage.name}")


@pytest.fixture(params=["cnn", "transformer"])
def grown(request: pytest.FixtureRequest) -> GrowingHost:
    return GrowingHost(make_host(request.param, lifecycle=FAST), OptimConfig(seed_lr=0.01))


def _blueprint(grown: GrowingHost) -> str:
    return "conv_heavy" if grown.model.kind == "cnn" else "mlp"


def test_host_optimizer_starts_with_exactly_the_host_parameters(grown: GrowingHost) -> None:
    assert _optimizer_ids(grown.host_optimizer) == _ids(grown.model.parameters())
    assert grown.seed_optimizers == {}
    assert grown.trainable_seed_slots() == []
    assert grown.slot_ids == grown.model.slot_ids
    assert grown.device == torch.device("cpu")


@pytest.mark.parametrize("blend", [BlendMode.LINEAR, BlendMode.GATED])
def test_germinated_seed_params_live_in_their_own_optimizer_only(
    grown: GrowingHost, blend: BlendMode
) -> None:
    slot_id = grown.slot_ids[0]
    seed = grown.germinate(slot_id, _blueprint(grown), blend)
    slot = grown.model.slot(slot_id)
    seed_ids = _ids(slot.seed_parameters())
    assert _ids(seed.parameters()) <= seed_ids
    assert (slot.gate is not None) is (blend is BlendMode.GATED)
    assert grown.trainable_seed_slots() == [slot_id]
    opt = grown.seed_optimizers[slot_id]
    assert _optimizer_ids(opt) == seed_ids
    assert all(group["lr"] == 0.01 for group in opt.param_groups)
    assert not seed_ids & _optimizer_ids(grown.host_optimizer)
    assert not seed_ids & _ids(grown.model.host_parameters())
    assert seed_ids <= _ids(grown.model.parameters())
    assert grown.model.seed_param_count() == sum(p.numel() for p in slot.seed_parameters())


@pytest.mark.parametrize("blend", [BlendMode.LINEAR, BlendMode.GATED])
def test_fossilize_moves_seed_params_into_the_host_optimizer(
    grown: GrowingHost, blend: BlendMode
) -> None:
    slot_id = grown.slot_ids[-1]
    grown.germinate(slot_id, _blueprint(grown), blend)
    slot = grown.model.slot(slot_id)
    seed_ids = _ids(slot.seed_parameters())
    _advance_to(grown, slot_id, SeedStage.HOLDING)
    assert slot_id in grown.seed_optimizers

    assert grown.advance(slot_id, GOOD)
    assert slot.stage is SeedStage.FOSSILIZED
    assert slot_id not in grown.seed_optimizers
    assert grown.trainable_seed_slots() == []
    assert seed_ids <= _optimizer_ids(grown.host_optimizer)
    new_group = grown.host_optimizer.param_groups[-1]
    assert _ids(new_group["params"]) == seed_ids
    assert new_group["lr"] == grown.optim.host_lr
    assert seed_ids <= _ids(grown.model.host_parameters())
    assert _ids(grown.model.host_parameters()) == _ids(grown.model.parameters())
    # Fossilized seeds still count against the parameter budget.
    assert grown.model.seed_param_count() == slot.seed_param_count() > 0


def test_refused_fossilize_keeps_the_seed_optimizer(grown: GrowingHost) -> None:
    slot_id = grown.slot_ids[0]
    grown.germinate(slot_id, "norm", BlendMode.LINEAR)
    _advance_to(grown, slot_id, SeedStage.HOLDING)
    result = grown.advance(slot_id, GateSignals(grads_finite=True, contribution=0.0))
    assert not result
    assert slot_id in grown.seed_optimizers
    assert not _ids(grown.model.slot(slot_id).seed_parameters()) & _optimizer_ids(
        grown.host_optimizer
    )


def test_fossilized_seed_cannot_be_pruned(grown: GrowingHost) -> None:
    slot_id = grown.slot_ids[0]
    grown.germinate(slot_id, "norm", BlendMode.LINEAR)
    _advance_to(grown, slot_id, SeedStage.FOSSILIZED)
    n_params = len(list(grown.model.parameters()))
    with pytest.raises(IllegalTransitionError):
        grown.prune(slot_id)
    assert grown.model.slot(slot_id).has_seed
    assert len(list(grown.model.parameters())) == n_params


@pytest.mark.parametrize(
    "stage", [SeedStage.GERMINATED, SeedStage.TRAINING, SeedStage.BLENDING, SeedStage.HOLDING]
)
def test_prune_removes_seed_params_everywhere_and_frees_the_module(
    grown: GrowingHost, stage: SeedStage
) -> None:
    slot_id = grown.slot_ids[0]
    seed_ref = weakref.ref(grown.germinate(slot_id, _blueprint(grown), BlendMode.GATED))
    slot = grown.model.slot(slot_id)
    assert slot.gate is not None
    gate_ref = weakref.ref(slot.gate)
    seed_ids = _ids(slot.seed_parameters())
    _advance_to(grown, slot_id, stage)
    # Train one step so the optimizer holds state (momentum) for the seed's params.
    x, y = make_batch(grown.model)
    grown.zero_grad()
    forward_backward(grown.model, x, y)
    grown.step()
    host_ids_before = _optimizer_ids(grown.host_optimizer)
    assert seed_ref() is not None and gate_ref() is not None

    grown.prune(slot_id)

    assert slot.stage is SeedStage.PRUNED
    assert slot_id not in grown.seed_optimizers
    assert not seed_ids & _ids(grown.model.parameters())
    assert not seed_ids & _all_optimizer_ids(grown)
    assert _optimizer_ids(grown.host_optimizer) == host_ids_before
    assert grown.model.seed_param_count() == 0
    grown.zero_grad()
    gc.collect()
    assert seed_ref() is None, "the pruned seed module is still referenced"
    assert gate_ref() is None, "the pruned gate is still referenced"


def test_prune_of_an_empty_slot_raises_and_changes_nothing(grown: GrowingHost) -> None:
    slot_id = grown.slot_ids[0]
    with pytest.raises(IllegalTransitionError, match="DORMANT -> PRUNED"):
        grown.prune(slot_id)
    assert grown.seed_optimizers == {}


def test_unknown_slot_raises_key_error_listing_slots(grown: GrowingHost) -> None:
    with pytest.raises(KeyError, match=f"no slot 'nope'.*{grown.slot_ids[0]}"):
        grown.germinate("nope", "norm", BlendMode.LINEAR)
    assert grown.seed_optimizers == {}


def test_germinate_of_a_non_fitting_blueprint_adds_no_optimizer() -> None:
    grown = GrowingHost(make_host("transformer"))
    with pytest.raises(ValueError, match="conv_light"):
        grown.germinate("block0", "conv_light", BlendMode.LINEAR)
    assert grown.seed_optimizers == {}
    assert grown.model.slot("block0").stage is SeedStage.DORMANT


def test_end_epoch_reports_cooldown_stages_entered_per_slot(grown: GrowingHost) -> None:
    first, second = grown.slot_ids[:2]
    grown.germinate(first, "norm", BlendMode.LINEAR)
    grown.germinate(second, "norm", BlendMode.LINEAR)
    grown.prune(first)
    assert grown.end_epoch() == {first: SeedStage.EMBARGOED}
    assert grown.end_epoch() == {first: SeedStage.RESETTING}
    assert grown.end_epoch() == {first: SeedStage.DORMANT}
    assert grown.end_epoch() == {}
    assert grown.model.slot(second).stage is SeedStage.GERMINATED
    assert grown.model.slot(second).lifecycle.epochs_in_stage == 4


def test_step_updates_seed_with_its_optimizer_and_zero_grad_clears_all(
    grown: GrowingHost,
) -> None:
    slot_id = grown.slot_ids[0]
    grown.germinate(slot_id, _blueprint(grown), BlendMode.LINEAR)
    grown.advance(slot_id, GOOD)  # TRAINING
    slot = grown.model.slot(slot_id)
    seed_before = [p.detach().clone() for p in slot.seed_parameters()]
    host_before = [p.detach().clone() for p in grown.model.host_parameters()]
    x, y = make_batch(grown.model)
    train_backward(grown.model, x, y)
    grown.step()
    seed_changed = [
        not torch.equal(a, p) for a, p in zip(seed_before, slot.seed_parameters(), strict=True)
    ]
    host_changed = [
        not torch.equal(a, p)
        for a, p in zip(host_before, grown.model.host_parameters(), strict=True)
    ]
    assert any(seed_changed)
    assert any(host_changed)
    grown.zero_grad()
    assert all(p.grad is None for p in grown.model.parameters())
