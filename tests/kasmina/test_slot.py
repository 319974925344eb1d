"""SeedSlot: zero-init planting, gradient isolation, blending, gating and counterfactuals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from esper.contracts import BlendMode, IllegalTransitionError, SeedStage
from esper.kasmina import (
    BlueprintFitError,
    CNNHost,
    GateSignals,
    GrowingHost,
    LifecycleConfig,
    OptimConfig,
    SeedSlot,
    SlotShape,
)
from esper.kasmina.blueprints import BLUEPRINTS
from esper.kasmina.incubation import incubating_slots, incubation_loss
from esper.kasmina.slot import GATE_INIT_LOGIT, ChannelGate
from tests.kasmina.factories import (
    FAST,
    fitting_cases,
    forward_backward,
    make_batch,
    make_host,
    train_backward,
)
from tests.ops import OpCounter

ALL_CASES = fitting_cases(all_slots=True)
FIRST_SLOT_CASES = fitting_cases(all_slots=False)
POSITIVE = GateSignals(grads_finite=True, contribution=1.0)


def test_every_blueprint_is_covered_by_some_host_case() -> None:
    covered = {case.values[2] for case in ALL_CASES}
    assert covered == set(BLUEPRINTS.names())
    kinds = {case.values[0] for case in ALL_CASES}
    assert kinds == {"cnn", "transformer"}


def _walk_to(slot: SeedSlot, stage: SeedStage) -> None:
    """Advance a GERMINATED seed along the success path to ``stage`` (FAST lifecycle)."""
    while slot.stage is not stage:
        before = slot.stage
        result = slot.advance(POSITIVE)
        if not result:
            slot.end_epoch()
            result = slot.advance(POSITIVE)
        assert result, result.reason
        assert slot.stage is not before


@pytest.mark.parametrize(("kind", "slot_id", "blueprint"), ALL_CASES)
def test_germinated_seed_leaves_host_outputs_bit_identical(
    kind: str, slot_id: str, blueprint: str
) -> None:
    host = make_host(kind)
    grown = copy.deepcopy(host)
    grown.slot(slot_id).germinate(blueprint, BlendMode.LINEAR)
    assert grown.slot(slot_id).stage is SeedStage.GERMINATED
    x, _ = make_batch(host)
    for mode in ("train", "eval"):
        host.train(mode == "train")
        grown.train(mode == "train")
        with torch.no_grad():
            assert torch.equal(host(x), grown(x)), mode


@pytest.mark.parametrize(("kind", "slot_id", "blueprint"), ALL_CASES)
def test_training_seed_leaves_host_grads_and_outputs_bit_identical(
    kind: str, slot_id: str, blueprint: str
) -> None:
    host = make_host(kind)
    grown = copy.deepcopy(host)
    slot = grown.slot(slot_id)
    slot.germinate(blueprint, BlendMode.LINEAR)
    assert slot.advance(GateSignals())
    assert slot.stage is SeedStage.TRAINING
    x, y = make_batch(host)

    out_host = forward_backward(host, x, y)
    out_grown = train_backward(grown, x, y)  # the host's pass, then the seed's incubation

    assert torch.equal(out_host, out_grown)
    host_params = dict(host.named_parameters())
    grown_params = dict(grown.named_parameters())
    seed_ids = {id(p) for p in slot.seed_parameters()}
    grown_host_params = {n: p for n, p in grown_params.items() if id(p) not in seed_ids}
    assert grown_host_params.keys() == host_params.keys()
    for name, p in host_params.items():
        assert p.grad is not None, name
        assert grown_host_params[name].grad is not None, name
        assert torch.equal(p.grad, grown_host_params[name].grad), name
    # BatchNorm running statistics are host state too (a widening seed has its own).
    grown_buffers = dict(grown.named_buffers())
    for name, b in host.named_buffers():
        if not name.endswith("_device_anchor"):
            assert torch.equal(b, grown_buffers[name]), name

    seed_grads = [p.grad for p in slot.seed_parameters()]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in seed_grads)
    assert all(g is None or bool(torch.isfinite(g).all()) for g in seed_grads)


def _slot_delta(host: nn.Module, slot: SeedSlot, x: torch.Tensor) -> torch.Tensor:
    """What the slot's seed changes in the host's output on ``x`` (against its alpha at
    0), in eval mode and without grads: a residual seed's delta or a widening's new units."""
    was_training = host.training
    alpha = slot._alpha_t.clone()
    host.eval()
    try:
        with torch.no_grad():
            with_seed = host(x)
            slot._alpha_t.zero_()
            return with_seed - host(x)
    finally:
        slot._alpha_t.copy_(alpha)
        host.train(was_training)


@pytest.mark.parametrize("stage", [SeedStage.BLENDING, SeedStage.HOLDING])
@pytest.mark.parametrize(("kind", "slot_id", "blueprint"), FIRST_SLOT_CASES)
def test_blending_and_holding_seed_start_at_zero_delta_and_learn_a_nonzero_one(
    kind: str, slot_id: str, blueprint: str, stage: SeedStage
) -> None:
    host = make_host(kind, lifecycle=FAST)
    alone = copy.deepcopy(host)
    grown = GrowingHost(host, OptimConfig(host_lr=0.05, seed_lr=0.1))
    grown.germinate(slot_id, blueprint, BlendMode.LINEAR)
    slot = host.slot(slot_id)
    _walk_to(slot, stage)
    assert slot.alpha > 0
    x, y = make_batch(host)

    host.eval()
    alone.eval()
    with torch.no_grad():
        assert torch.equal(host(x), alone(x))
    assert not bool(_slot_delta(host, slot, x).any())

    host.train()
    grown.zero_grad()
    forward_backward(host, x, y)
    grown.step()
    assert slot.stage is stage
    assert bool(_slot_delta(host, slot, x).abs().sum() > 0)


@pytest.mark.parametrize(
    ("stage", "detached"),
    [
        (SeedStage.TRAINING, True),
        (SeedStage.BLENDING, True),
        (SeedStage.HOLDING, True),
        (SeedStage.FOSSILIZED, False),
    ],
)
@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_seed_sees_detached_host_activation_until_fossilized(
    kind: str, stage: SeedStage, detached: bool
) -> None:
    host = make_host(kind, lifecycle=FAST)
    slot = host.slot(host.slot_ids[0])
    slot.germinate("mlp", BlendMode.LINEAR)
    _walk_to(slot, stage)
    seen: list[bool] = []
    assert slot.seed is not None
    slot.seed.register_forward_pre_hook(lambda _m, args: seen.append(args[0].requires_grad))
    x, y = make_batch(host)
    train_backward(host, x, y)
    assert seen == [not detached]


def test_training_seed_runs_only_in_the_incubation_pass() -> None:
    host = make_host("cnn")
    slot = host.slot("stage0")
    slot.germinate("conv_light", BlendMode.LINEAR)
    slot.advance(GateSignals())
    calls: list[int] = []
    assert slot.seed is not None
    slot.seed.register_forward_hook(lambda *_: calls.append(1))
    x, y = make_batch(host)
    host.eval()
    host(x)
    host.train()
    with torch.no_grad():
        host(x)
    host(x)
    assert calls == []
    incubation_loss(host, incubating_slots(host), x, y)
    assert calls == [1]


def test_germinated_seed_is_never_run() -> None:
    host = make_host("transformer")
    slot = host.slot("block0")
    slot.germinate("mlp", BlendMode.LINEAR)
    calls: list[int] = []
    assert slot.seed is not None
    slot.seed.register_forward_hook(lambda *_: calls.append(1))
    x, y = make_batch(host)
    forward_backward(host, x, y)
    assert calls == []
    assert all(p.grad is None for p in slot.seed_parameters())


def test_blending_output_is_host_plus_alpha_times_seed_output() -> None:
    slot = SeedSlot("s", SlotShape("transformer", 8, (4,), causal=True), FAST)
    seed = slot.germinate("lora", BlendMode.LINEAR)
    with torch.no_grad():
        for p in seed.parameters():
            p.normal_()
    slot.advance(POSITIVE)  # TRAINING
    slot.advance(POSITIVE)  # BLENDING
    assert slot.stage is SeedStage.BLENDING
    h = torch.randn(2, 4, 8)
    with torch.no_grad():
        expected = h + slot.alpha * seed(h)
        assert torch.allclose(slot(h), expected)
        assert not torch.allclose(slot(h), h)


def test_germinating_a_non_fitting_blueprint_raises_one_fit_error_and_leaves_slot_dormant() -> None:
    host = make_host("transformer")
    slot = host.slot("block0")
    with pytest.raises(BlueprintFitError, match=r"'conv_light'.*'transformer'"):
        slot.germinate("conv_light", BlendMode.LINEAR)
    assert slot.stage is SeedStage.DORMANT
    assert slot.seed is None
    assert slot.lifecycle.blueprint is None
    # The slot is still usable.
    slot.germinate("norm", BlendMode.LINEAR)
    assert slot.stage is SeedStage.GERMINATED


def test_germinating_an_unknown_blueprint_raises_key_error_listing_known_ones() -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)))
    with pytest.raises(KeyError, match=r"unknown blueprint 'nope'.*conv_light"):
        slot.germinate("nope", BlendMode.LINEAR)
    assert slot.stage is SeedStage.DORMANT


def test_germinating_with_invalid_blend_mode_raises_and_leaves_slot_dormant() -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)))
    with pytest.raises(ValueError, match="BlendMode"):
        slot.germinate("conv_light", 99)  # type: ignore[arg-type]
    assert slot.stage is SeedStage.DORMANT
    assert slot.seed is None
    assert slot.lifecycle.blueprint is None


@pytest.mark.parametrize(
    "stage",
    [
        SeedStage.GERMINATED,
        SeedStage.TRAINING,
        SeedStage.PRUNED,
        SeedStage.EMBARGOED,
        SeedStage.RESETTING,
    ],
)
def test_germinating_an_occupied_or_cooling_slot_raises_and_keeps_its_state(
    stage: SeedStage,
) -> None:
    slot = SeedSlot(
        "s", SlotShape("cnn", 8, (4, 4)), LifecycleConfig(embargo_epochs=2, reset_epochs=2)
    )
    slot.germinate("norm", BlendMode.LINEAR)
    if stage is SeedStage.TRAINING:
        slot.advance(POSITIVE)
    elif stage in (SeedStage.PRUNED, SeedStage.EMBARGOED, SeedStage.RESETTING):
        slot.prune()
        while slot.stage is not stage:
            slot.end_epoch()
    seed_before = slot.seed
    with pytest.raises(IllegalTransitionError, match=f"{stage.name} -> GERMINATED"):
        slot.germinate("conv_light", BlendMode.LINEAR)
    assert slot.stage is stage
    assert slot.seed is seed_before
    assert slot.lifecycle.blueprint == "norm"


def test_prune_drops_the_seed_module_and_its_parameters() -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)))
    slot.germinate("conv_heavy", BlendMode.GATED)
    assert slot.has_seed and slot.gate is not None
    assert len(list(slot.parameters())) > 0
    slot.prune()
    assert slot.stage is SeedStage.PRUNED
    assert not slot.has_seed and slot.gate is None
    assert list(slot.parameters()) == []
    assert slot.seed_param_count() == 0


def test_prune_of_fossilized_slot_raises_and_keeps_the_seed() -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)), FAST)
    slot.germinate("conv_light", BlendMode.LINEAR)
    _walk_to(slot, SeedStage.FOSSILIZED)
    with pytest.raises(IllegalTransitionError, match="FOSSILIZED -> PRUNED"):
        slot.prune()
    assert slot.stage is SeedStage.FOSSILIZED
    assert slot.has_seed


@pytest.mark.parametrize(
    ("stage", "blends"),
    [
        (SeedStage.GERMINATED, False),
        (SeedStage.TRAINING, False),
        (SeedStage.BLENDING, True),
        (SeedStage.HOLDING, True),
        (SeedStage.FOSSILIZED, True),
    ],
)
def test_blends_output_only_from_blending_on(stage: SeedStage, blends: bool) -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)), FAST)
    assert not slot.blends_output
    slot.germinate("norm", BlendMode.LINEAR)
    _walk_to(slot, stage)
    assert slot.blends_output is blends


def test_gated_blend_adds_an_almost_open_per_channel_gate_to_the_seed_params() -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)))
    slot.germinate("conv_light", BlendMode.GATED)
    assert slot.gate is not None
    assert torch.equal(slot.gate.logit, torch.full((8,), GATE_INIT_LOGIT))
    gate_ids = {id(p) for p in slot.gate.parameters()}
    assert gate_ids <= {id(p) for p in slot.seed_parameters()}
    assert slot.seed_param_count() == BLUEPRINTS.get("conv_light").param_count(slot.shape) + 8


@pytest.mark.parametrize("blend", [m for m in BlendMode if m is not BlendMode.GATED])
def test_ungated_blends_have_no_gate(blend: BlendMode) -> None:
    slot = SeedSlot("s", SlotShape("cnn", 8, (4, 4)))
    slot.germinate("conv_light", blend)
    assert slot.gate is None
    assert slot.seed_param_count() == BLUEPRINTS.get("conv_light").param_count(slot.shape)


@pytest.mark.parametrize(
    ("shape", "delta_shape", "channel_dim"),
    [
        (SlotShape("cnn", 3, (2, 2)), (2, 3, 2, 2), 1),
        (SlotShape("transformer", 3, (5,), causal=True), (2, 5, 3), -1),
    ],
)
def test_channel_gate_scales_each_channel_by_sigmoid_of_its_logit(
    shape: SlotShape, delta_shape: tuple[int, ...], channel_dim: int
) -> None:
    gate = ChannelGate(shape)
    with torch.no_grad():
        gate.logit.copy_(torch.tensor([-2.0, 0.0, 4.0]))
    out = gate(torch.ones(delta_shape))
    expected = torch.sigmoid(gate.logit.detach())
    for c in range(3):
        assert torch.allclose(
            out.select(channel_dim, c), expected[c].expand_as(out.select(channel_dim, c))
        )


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_counterfactual_forks_append_one_replica_per_seed_with_that_seed_off(kind: str) -> None:
    """Two HOLDING seeds: the host returns [as is, first seed off, second seed off]."""
    host = make_host(kind, lifecycle=FAST)
    first, second = (host.slot(s) for s in host.slot_ids[:2])
    for slot in (first, second):
        seed = slot.germinate("mlp", BlendMode.LINEAR)
        _walk_to(slot, SeedStage.HOLDING)
        with torch.no_grad():
            for p in seed.parameters():
                p.normal_(std=0.5)
    host.eval()
    x, _ = make_batch(host)

    def with_alphas(a: float, b: float) -> torch.Tensor:
        kept = first._alpha_t.clone(), second._alpha_t.clone()
        first._alpha_t.fill_(a)
        second._alpha_t.fill_(b)
        out = host(x)
        first._alpha_t.copy_(kept[0])
        second._alpha_t.copy_(kept[1])
        return out

    with torch.no_grad():
        expected = [with_alphas(1.0, 1.0), with_alphas(0.0, 1.0), with_alphas(1.0, 0.0)]
        first.set_counterfactual_fork(1)
        second.set_counterfactual_fork(2)
        forked = host(x)
        first.set_counterfactual_fork(None)
        second.set_counterfactual_fork(None)
        again = host(x)
    assert not torch.allclose(expected[0], expected[1])
    assert not torch.allclose(expected[0], expected[2])
    n = x.shape[0]
    assert forked.shape[0] == 3 * n
    for r, reference in enumerate(expected):
        assert torch.allclose(forked[r * n : (r + 1) * n], reference, atol=1e-5), r
    assert torch.equal(again, expected[0])


def test_counterfactual_fork_needs_a_live_replica() -> None:
    with pytest.raises(ValueError, match="at least 1 live replica"):
        make_host("cnn").slot("stage0").set_counterfactual_fork(0)


def test_slot_alpha_and_stage_mirror_its_lifecycle_and_show_in_repr() -> None:
    slot = SeedSlot("stage1", SlotShape("cnn", 8, (4, 4)), FAST)
    slot.germinate("norm", BlendMode.COSINE)
    _walk_to(slot, SeedStage.BLENDING)
    assert slot.stage is slot.lifecycle.stage is SeedStage.BLENDING
    assert slot.alpha == slot.lifecycle.alpha == 1.0
    text = repr(slot)
    assert "id=stage1" in text and "stage=BLENDING" in text and "blueprint=norm" in text


def test_a_lifecycle_op_writes_the_alpha_buffer_only_when_alpha_moves() -> None:
    """A fill a slot an env an epoch was a kernel launch on a GPU, nearly always of the
    value already there (an empty slot's 0); the buffer still follows every move."""
    ramp = LifecycleConfig(min_training_epochs=0, blend_epochs=4, min_holding_epochs=0)
    host = make_host("cnn", lifecycle=ramp)
    slot = host.slot(host.slot_ids[0])
    with OpCounter() as idle:
        slot.end_epoch()  # DORMANT: alpha stays 0
    assert idle.ops["fill_"] == 0
    slot.germinate("mlp", BlendMode.LINEAR)
    _walk_to(slot, SeedStage.BLENDING)
    alphas = [(slot.alpha, float(slot.alpha_tensor))]
    for _ in range(10):  # it blends in over 4 epochs
        if slot.stage is not SeedStage.BLENDING:
            break
        slot.end_epoch()
        slot.advance(POSITIVE)
        alphas.append((slot.alpha, float(slot.alpha_tensor)))
    assert slot.stage is SeedStage.HOLDING and len({a for a, _ in alphas}) > 2  # it ramped
    assert all(buffer == alpha for alpha, buffer in alphas)
    assert alphas[-1][0] == 1.0
    copied = copy.deepcopy(slot)  # the buffer and the value last written go together
    copied.prune()
    assert float(copied.alpha_tensor) == 0.0 and float(slot.alpha_tensor) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_planting_a_seed_on_a_gpu_host_waits_for_nothing() -> None:
    """A seed is built on the CPU and uploaded mid-rollout: a blocking upload from
    pageable memory would synchronise the stream once per tensor (CUDA's sync debug mode
    raises on it). Its values are the CPU-built seed's."""
    torch.manual_seed(0)
    on_cpu = GrowingHost(CNNHost(channels=(8, 16)))
    on_gpu = copy.deepcopy(on_cpu)
    on_gpu.model.cuda()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for host in (on_cpu, on_gpu):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                host.germinate("stage0", "conv_light", BlendMode.GATED)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for name, value in on_cpu.model.state_dict().items():
        assert torch.equal(on_gpu.model.state_dict()[name].cpu(), value), name
