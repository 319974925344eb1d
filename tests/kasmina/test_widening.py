"""Widening seeds (kasmina/widening.py): new units of the host's layers, function-preserving
when planted, merged into a plain wider network when fossilized, and carried through
rollback, checkpoints and the counterfactual like any seed."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GateSignals, GrowingHost, HostModel, OptimConfig, TransformerHost
from esper.kasmina.architecture import build_architecture, final_architecture, final_param_count
from esper.kasmina.blueprints import BLUEPRINTS
from esper.kasmina.sgd import MOMENTUM_BUFFER
from esper.kasmina.sizing import count_parameters
from esper.kasmina.widen_init import CANDIDATES_PER_UNIT
from esper.kasmina.widening import ConvWidening, unit_scores
from esper.tolaria.counterfactual import validate_with_counterfactuals
from esper.tolaria.epoch import train_step
from esper.tolaria.snapshot import HostSnapshot
from tests.kasmina.factories import FAST, make_batch

POSITIVE = GateSignals(grads_finite=True, contribution=1.0)
#: Two merged networks computing the same function may still sum in another order.
MERGE_TOLERANCE = 1e-5


def _cnn(convs: int = 2, channels: tuple[int, ...] = (2, 4, 8), seed: int = 0) -> CNNHost:
    torch.manual_seed(seed)
    return CNNHost((1, 8, 8), 10, channels=channels, convs_per_stage=convs, lifecycle=FAST)


def _transformer(seed: int = 0) -> TransformerHost:
    torch.manual_seed(seed)
    return TransformerHost(
        vocab_size=11, seq_len=8, d_model=16, n_heads=2, n_layers=2, lifecycle=FAST
    )


HOSTS = {
    "cnn-1conv": lambda: _cnn(convs=1),
    "cnn-2conv": lambda: _cnn(convs=2),
    "transformer": _transformer,
}


def _to(env: GrowingHost, slot_id: str, stage: SeedStage) -> None:
    """Walk the seed to ``stage``, ending epochs where the clock asks for one."""
    while env.model.slot(slot_id).stage is not stage:
        result = env.advance(slot_id, POSITIVE)
        if not result:
            assert result.waiting, result.reason
            env.end_epoch()


def _train(env: GrowingHost, steps: int = 3, seed: int = 2) -> None:
    for k in range(steps):
        x, y = make_batch(env.model, n=8, seed=seed + k)
        train_step(env, x, y)
        env.step()


def _eval(model: HostModel, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    finally:
        model.train()


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("mode", [BlendMode.LINEAR, BlendMode.GATED])
def test_a_planted_widening_leaves_the_function_unchanged_at_full_strength(
    host: str, mode: BlendMode
) -> None:
    for slot_id in HOSTS[host]().slot_ids:
        model = HOSTS[host]()
        x, _ = make_batch(model, n=6)
        before = _eval(model, x)
        env = GrowingHost(model)
        env.germinate(slot_id, "widen", mode)
        _to(env, slot_id, SeedStage.HOLDING)  # alpha 1: the new units fully in
        assert model.slot(slot_id).alpha == 1.0
        torch.testing.assert_close(_eval(model, x), before, atol=1e-6, rtol=0)


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("mode", [BlendMode.LINEAR, BlendMode.GATED])
def test_a_fossilized_widening_is_merged_into_wider_layers_that_compute_the_blended_network(
    host: str, mode: BlendMode
) -> None:
    model = HOSTS[host]()
    env = GrowingHost(model, OptimConfig(host_lr=0.05, seed_lr=0.1))
    slot_id = model.slot_ids[0]
    env.germinate(slot_id, "widen", mode)
    _to(env, slot_id, SeedStage.TRAINING)
    _train(env)  # the seed learns in incubation: its outgoing weights leave zero
    _to(env, slot_id, SeedStage.HOLDING)
    _train(env)
    x, _ = make_batch(model, n=6, seed=9)
    blended = _eval(model, x)
    added = model.slot(slot_id).seed_param_count()
    total = count_parameters(model)
    shapes = {n: p.shape for n, p in model.named_parameters()}

    _to(env, slot_id, SeedStage.FOSSILIZED)

    slot = model.slot(slot_id)
    assert slot.seed is None and slot.gate is None and slot.merged
    # The rent counts what the merge added: the seed's units and the blocks between old
    # and new units, held at zero while it lived and trained from now on.
    grew = count_parameters(model) - (total - added)
    assert slot.seed_param_count() == grew >= added - _gate_params(mode, shapes, slot_id)
    wider = [n for n, p in model.named_parameters() if n in shapes and p.shape != shapes[n]]
    assert wider, "merging must widen some of the host's own layers"
    assert all(
        p.shape[d] >= shapes[n][d] for n, p in model.named_parameters() for d in range(p.dim())
    )
    torch.testing.assert_close(_eval(model, x), blended, atol=MERGE_TOLERANCE, rtol=0)
    assert final_architecture(model)[0] is not None
    assert final_param_count(model) == count_parameters(model)


def _gate_params(mode: BlendMode, shapes: dict[str, torch.Size], slot_id: str) -> int:
    """The gate's logits are folded into the merged weights, not kept."""
    if mode is not BlendMode.GATED:
        return 0
    return shapes[f"slots.{slot_id}.gate.logit"].numel()


def test_merged_stage_has_the_shapes_of_the_plain_wider_cnn() -> None:
    model = _cnn()
    env = GrowingHost(model)
    env.germinate("stage1", "widen", BlendMode.LINEAR)
    _to(env, "stage1", SeedStage.FOSSILIZED)
    plain = _cnn(channels=(2, 8, 8))
    grown = {n: p.shape for n, p in model.named_parameters()}
    assert grown == {n: p.shape for n, p in plain.named_parameters()}
    assert model.stages[1].convs()[1].out_channels == 8
    assert model.stages[2].convs()[0].in_channels == 8


@pytest.mark.parametrize("order", ["first-then-second", "second-then-first"])
def test_neighbouring_widenings_merge_in_either_order_without_changing_the_function(
    order: str,
) -> None:
    model = _cnn(convs=2)
    env = GrowingHost(model, OptimConfig(host_lr=0.05, seed_lr=0.1))
    for slot_id in ("stage0", "stage1", "stage2"):
        env.germinate(slot_id, "widen", BlendMode.GATED)
        _to(env, slot_id, SeedStage.TRAINING)
    _train(env)
    for slot_id in ("stage0", "stage1", "stage2"):
        _to(env, slot_id, SeedStage.HOLDING)
    _train(env)
    x, _ = make_batch(model, n=6, seed=9)
    blended = _eval(model, x)
    ids = ["stage0", "stage1"] if order == "first-then-second" else ["stage1", "stage0"]
    for slot_id in ids:
        env.advance(slot_id, POSITIVE)
        torch.testing.assert_close(_eval(model, x), blended, atol=MERGE_TOLERANCE, rtol=0)
    _train(env)  # and the half-merged host trains
    assert torch.isfinite(_eval(model, x)).all()
    env.advance("stage2", POSITIVE)
    assert {n: p.shape for n, p in model.named_parameters()} == {
        n: p.shape for n, p in _cnn(channels=(4, 8, 16)).named_parameters()
    }


def test_merging_carries_the_momentum_of_host_and_seed() -> None:
    model = _cnn()
    env = GrowingHost(model, OptimConfig(host_lr=0.05, seed_lr=0.1))
    env.germinate("stage2", "widen", BlendMode.LINEAR)
    _to(env, "stage2", SeedStage.HOLDING)
    _train(env)
    head = model.head.weight
    host_buf = env.host_optimizer.state[head][MOMENTUM_BUFFER].clone()
    seed = model.slot("stage2").seed
    seed_buf = env.seed_optimizers["stage2"].state[seed.consumer.weight][MOMENTUM_BUFFER].clone()
    env.advance("stage2", POSITIVE)
    merged = env.host_optimizer.state[head][MOMENTUM_BUFFER]
    assert merged.shape == head.shape == (10, 16)
    assert torch.equal(merged, torch.cat([host_buf, seed_buf], dim=1))
    assert "stage2" not in env.seed_optimizers
    _train(env)  # the merged host steps with its merged momentum


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_merged_network_saves_loads_weights_only_and_resumes_exactly(host: str) -> None:
    model = HOSTS[host]()
    env = GrowingHost(model)
    slot_id = model.slot_ids[-1]
    env.germinate(slot_id, "widen", BlendMode.GATED)
    _to(env, slot_id, SeedStage.FOSSILIZED)
    _train(env)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": env.host_optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    rebuilt = HOSTS[host]()
    build_architecture(rebuilt, final_architecture(model))  # the same wider layers
    rebuilt.load_state_dict(saved["model"])
    resumed = GrowingHost(rebuilt)
    resumed.host_optimizer.load_state_dict(saved["optim"])
    x, _ = make_batch(model, n=6, seed=9)
    assert torch.equal(_eval(rebuilt, x), _eval(model, x))
    _train(env, seed=20)
    _train(resumed, seed=20)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), rebuilt.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_rollback_restores_a_widened_host_bit_for_bit() -> None:
    model = _cnn()
    env = GrowingHost(model)
    env.germinate("stage1", "widen", BlendMode.LINEAR)
    _to(env, "stage1", SeedStage.HOLDING)
    _train(env)
    snapshot = HostSnapshot.take(env, epoch=3)
    before = {n: t.clone() for n, t in env.model.state_dict().items()}
    env.advance("stage1", POSITIVE)  # merged: shapes change
    _train(env)
    snapshot.restore(env)
    after = env.model.state_dict()
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    assert env.model.slot("stage1").stage is SeedStage.HOLDING and env.model.slot("stage1").widens
    # And a snapshot of the merged host restores the merged host.
    env.advance("stage1", POSITIVE)
    merged = HostSnapshot.take(env, epoch=4)
    state = {n: t.clone() for n, t in env.model.state_dict().items()}
    _train(env)
    merged.restore(env)
    for name, t in state.items():
        assert torch.equal(env.model.state_dict()[name], t), name


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_the_counterfactual_of_a_widening_is_the_host_without_its_new_units(host: str) -> None:
    model = HOSTS[host]()
    env = GrowingHost(model, OptimConfig(host_lr=0.05, seed_lr=0.2))
    slot_id = model.slot_ids[0]
    env.germinate(slot_id, "widen", BlendMode.LINEAR)
    _to(env, slot_id, SeedStage.TRAINING)
    _train(env, steps=6)
    _to(env, slot_id, SeedStage.HOLDING)
    batches = [make_batch(model, n=16, seed=30 + k) for k in range(3)]
    _, acc, cf = validate_with_counterfactuals([env], batches, torch.device("cpu"))
    slot = model.slot(slot_id)
    slot._alpha_t.zero_()
    _, acc_without, _ = validate_with_counterfactuals([env], batches, torch.device("cpu"))
    slot._alpha_t.fill_(1.0)
    s = model.slot_ids.index(slot_id)
    assert torch.equal(cf[0, s], acc_without[0])
    _, acc_again, _ = validate_with_counterfactuals([env], batches, torch.device("cpu"))
    assert torch.equal(acc_again, acc)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_the_static_build_of_a_widened_architecture_is_freshly_initialised(host: str) -> None:
    model = HOSTS[host]()
    env = GrowingHost(model)
    slot_id = model.slot_ids[0]
    env.germinate(slot_id, "widen", BlendMode.LINEAR)
    _to(env, slot_id, SeedStage.FOSSILIZED)
    static = HOSTS[host]()
    build_architecture(static, final_architecture(model))
    assert {n: p.shape for n, p in static.named_parameters()} == {
        n: p.shape for n, p in model.named_parameters()
    }
    assert static.slot(slot_id).stage is SeedStage.FOSSILIZED and static.slot(slot_id).merged
    # No block of the static network starts at zero: its layers were drawn afresh.
    for layer in static.widened_layers(slot_id):
        weight = layer.weight
        if weight.dim() > 1:
            assert bool((weight.flatten(1).abs().sum(dim=1) > 0).all())
            assert bool((weight.transpose(0, 1).flatten(1).abs().sum(dim=1) > 0).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    channels=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    convs=st.integers(1, 3),
    n_classes=st.integers(2, 12),
    image=st.sampled_from([(1, 8, 8), (3, 6, 6)]),
)
def test_the_widen_blueprint_counts_exactly_what_it_builds_on_any_cnn_slot(
    channels: list[int], convs: int, n_classes: int, image: tuple[int, int, int]
) -> None:
    host = CNNHost(image, n_classes, channels=channels, convs_per_stage=convs)
    bp = BLUEPRINTS.get("widen")
    for slot in host.iter_slots():
        module = bp.instantiate(slot.shape)
        assert bp.param_count(slot.shape) == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("fork", [None, 2])
def test_a_widening_apart_gives_the_parts_it_would_concatenate(fork: int | None) -> None:
    """``apart=True`` hands a CONCAT widening's channels, and in a counterfactual fork
    the replica the slot appends, back on their own (the CNN host pools them before it
    joins them); joined, they are what the slot returns otherwise."""
    env = GrowingHost(_cnn(convs=2))
    env.germinate("stage1", "widen", BlendMode.GATED)
    _to(env, "stage1", SeedStage.BLENDING)
    slot = env.model.slot("stage1")
    torch.manual_seed(1)
    rows = 4 if fork is None else 4 * fork
    h, context = torch.randn(rows, 4, 4, 4), torch.randn(rows, 2, 4, 4)
    slot.set_counterfactual_fork(fork)
    joined = slot(h, context)
    parts = slot(h, context, apart=True)
    slot.set_counterfactual_fork(None)
    assert parts.extra is not None and torch.equal(parts.joined(), joined)
    if fork is None:
        assert parts.replica is None
    else:
        assert parts.replica is not None and torch.equal(parts.replica, h[: rows // fork])
        _, extra = parts.rows_joined()
        assert extra is not None and not extra[rows:].any()  # the replica's new channels


def test_a_widening_without_context_is_refused_with_the_fix() -> None:
    model = _cnn()
    env = GrowingHost(model)
    env.germinate("stage0", "widen", BlendMode.LINEAR)
    _to(env, "stage0", SeedStage.HOLDING)
    with pytest.raises(ValueError, match="must call slot\\(h, context\\)"):
        model.slot("stage0")(torch.zeros(1, 2, 8, 8))


def test_only_a_fossilized_widening_can_be_absorbed() -> None:
    model = _cnn()
    env = GrowingHost(model)
    env.germinate("stage0", "conv_light", BlendMode.LINEAR)
    with pytest.raises(ValueError, match="only a fossilized widening seed"):
        model.slot("stage0").absorb(1)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_the_gradient_start_keeps_the_candidates_the_loss_most_needs_and_changes_nothing(
    host: str,
) -> None:
    model = HOSTS[host]()
    env = GrowingHost(model, widen_init="gradient")
    x, y = make_batch(model, n=8, seed=3)
    train_step(env, x, y)  # leaves gradients, and the batch as the env's probe
    env.step()
    train_step(env, x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    before = _eval(model, x)
    slot_id = model.slot_ids[0]

    # The same draw, by hand: the pool of candidates and each one's score.
    reference = copy.deepcopy(model)
    state = torch.random.get_rng_state()
    planted = env.germinate(slot_id, "widen", BlendMode.LINEAR)
    torch.random.set_rng_state(state)
    probe = reference.slot(slot_id)
    probe.germinate("widen", BlendMode.LINEAR)
    pool = type(probe.seed)(probe.seed.shape, probe.seed.units * CANDIDATES_PER_UNIT)
    probe.seed = pool
    probe.incubating = True
    reference.train()
    for p in reference.parameters():
        p.grad = None
    out = reference(x)
    reference.loss_and_correct(out, y)[0].backward()
    best = unit_scores(pool).topk(planted.units).indices.sort().values

    assert planted.units == BLUEPRINTS.get("widen").build(model.slot(slot_id).shape).units
    first_in = planted.convs()[0].weight if isinstance(planted, ConvWidening) else planted.up.weight
    pool_in = pool.convs()[0].weight if isinstance(pool, ConvWidening) else pool.up.weight
    assert torch.equal(first_in, pool_in[best])
    assert not bool(planted.outgoing().any())  # still function-preserving
    torch.testing.assert_close(_eval(model, x), before, atol=0, rtol=0)
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n]), n
    for n, b in buffers.items():
        assert torch.equal(dict(model.named_buffers())[n], b), n
    optimized = env.seed_optimizers[slot_id].param_groups[0]["params"]
    assert {id(p) for p in optimized} == {id(p) for p in model.slot(slot_id).seed_parameters()}


def test_the_gradient_start_without_a_trained_batch_keeps_the_draw() -> None:
    torch.manual_seed(5)
    random_env = GrowingHost(_cnn(seed=1), widen_init="random")
    torch.manual_seed(5)
    gradient_env = GrowingHost(_cnn(seed=1), widen_init="gradient")
    torch.manual_seed(5)
    a = random_env.germinate("stage0", "widen", BlendMode.LINEAR)
    torch.manual_seed(5)
    b = gradient_env.germinate("stage0", "widen", BlendMode.LINEAR)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="widen_init must be one of"):
        GrowingHost(_cnn(), widen_init="gradmax")


def test_a_blending_widening_counts_as_the_merged_network_its_static_control_builds() -> None:
    model = _cnn()
    env = GrowingHost(model)
    env.germinate("stage1", "widen", BlendMode.LINEAR)
    _to(env, "stage1", SeedStage.BLENDING)
    static = _cnn()
    build_architecture(static, final_architecture(model))
    assert final_param_count(model) == count_parameters(static) > count_parameters(model)
    assert model.slot("stage1").stage is SeedStage.BLENDING  # counting changed nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("host", sorted(HOSTS))
def test_a_widening_grows_merges_and_matches_on_cuda(host: str) -> None:
    model = HOSTS[host]().to("cuda")
    env = GrowingHost(model, OptimConfig(host_lr=0.05, seed_lr=0.1), widen_init="gradient")
    x, y = (t.to("cuda") for t in make_batch(model, n=8, seed=3))
    train_step(env, x, y)
    env.step()
    before = _eval(model, x)
    slot_id = model.slot_ids[0]
    seed = env.germinate(slot_id, "widen", BlendMode.GATED)
    assert all(p.device.type == "cuda" for p in seed.parameters())
    _to(env, slot_id, SeedStage.HOLDING)
    torch.testing.assert_close(_eval(model, x), before, atol=1e-5, rtol=0)
    for k in range(3):
        train_step(env, *(t.to("cuda") for t in make_batch(model, n=8, seed=40 + k)))
        env.step()
    blended = _eval(model, x)
    env.advance(slot_id, POSITIVE)
    assert model.slot(slot_id).merged
    torch.testing.assert_close(_eval(model, x), blended, atol=1e-4, rtol=0)
    train_step(env, x, y)
    env.step()
    assert all(p.device.type == "cuda" for p in model.parameters())
