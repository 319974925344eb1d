"""MorphogeneticVecEnv applies ops through the lifecycle and prices them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from esper.contracts import BlendMode, LifecycleOp, SeedStage
from esper.mdp.env_config import EnvConfig
from esper.mdp.pairing import Pairing
from esper.tolaria.snapshot import HostSnapshot
from tests.mdp.envs import small_env


def _ready(n_envs: int = 2):  # type: ignore[no-untyped-def]
    env = small_env(n_envs, episode_epochs=4)
    env.reset()
    env.observe()
    return env


def _metrics(env) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(env.metrics().tolist())


def test_germinate_plants_the_chosen_blueprint_with_the_chosen_blend() -> None:
    env = _ready()
    bp = env.blueprint_names.index("widen")
    blend = list(env.blend_modes).index(BlendMode.COSINE)
    actions = np.array([[LifecycleOp.GERMINATE, 1, bp, blend], [LifecycleOp.WAIT, 0, 0, 0]])
    outcome = env.apply(actions, _metrics(env))
    slot = env.hosts[0].model.slot(env.slot_ids[1])
    assert slot.stage is SeedStage.GERMINATED
    assert slot.lifecycle.blueprint == "widen" and slot.lifecycle.blend_mode is BlendMode.COSINE
    assert outcome.germinated.tolist() == [True, False]
    assert outcome.applied.tolist() == [True, False]
    assert env.seed_params()[0] > 0 and env.seed_params()[1] == 0


def test_a_germination_draws_its_seed_per_key_and_reseeds_no_gpu_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeds are built on the CPU; torch.manual_seed also reseeded every GPU generator,
    which fork_rng(devices=[]) did not restore (and formatted a stack trace a call)."""
    drawn = []
    for _ in range(2):
        env = _ready()
        reseeded: list[int] = []
        monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
        bp = env.blueprint_names.index("widen")
        actions = np.array([[LifecycleOp.GERMINATE, 1, bp, 0], [LifecycleOp.WAIT, 0, 0, 0]])
        before = torch.get_rng_state()
        env.apply(actions, _metrics(env))
        assert torch.equal(torch.get_rng_state(), before)  # the global stream untouched
        assert reseeded == []
        monkeypatch.undo()
        drawn.append(
            [p.clone() for p in env.hosts[0].model.slot(env.slot_ids[1]).seed.parameters()]
        )
    for a, b in zip(*drawn, strict=True):
        assert torch.equal(a, b)


def test_an_op_the_mask_forbids_is_flagged_illegal_and_changes_nothing() -> None:
    env = _ready()
    actions = np.array([[LifecycleOp.PRUNE, 0, 0, 0], [LifecycleOp.ADVANCE, 1, 0, 0]])
    outcome = env.apply(actions, _metrics(env))
    assert outcome.illegal.tolist() == [True, True]
    assert (env.stages() == SeedStage.DORMANT).all()


WAIT = np.array([[LifecycleOp.WAIT, 0, 0, 0]])


def _step(env, actions: np.ndarray, metrics: np.ndarray | None = None):  # type: ignore[no-untyped-def]
    """One decision and the epoch after it, as the rollout loop takes them."""
    outcome = env.apply(actions, _metrics(env) if metrics is None else metrics)
    env.train_epoch()
    env.observe()
    return outcome


def _clock_events(env) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(e.stage_to, e.reason) for e in env.drain_events() if e.kind == "advanced"]


def test_the_clock_carries_a_planted_seed_to_holding_without_the_policy() -> None:
    env = _ready(1)
    lifecycle = env.config.lifecycle
    _step(env, np.array([[LifecycleOp.GERMINATE, 0, 0, 0]]))
    slot = env.hosts[0].model.slot(env.slot_ids[0])
    seen = [slot.stage]
    for _ in range(1 + lifecycle.min_training_epochs + lifecycle.blend_epochs):
        _step(env, WAIT)
        seen.append(slot.stage)
    assert seen == [
        SeedStage.GERMINATED,
        SeedStage.TRAINING,
        *[SeedStage.TRAINING] * (lifecycle.min_training_epochs - 1),
        SeedStage.BLENDING,
        *[SeedStage.BLENDING] * (lifecycle.blend_epochs - 1),
        SeedStage.HOLDING,
    ]


def test_clock_advances_are_reported_as_such() -> None:
    env = _ready(1)
    env.drain_events()
    _step(env, np.array([[LifecycleOp.GERMINATE, 0, 0, 0]]))
    _step(env, WAIT)
    assert ("TRAINING", "clock") in _clock_events(env)


def _holding(env) -> None:  # type: ignore[no-untyped-def]
    """Plant a seed in env 0's first slot and wait until FOSSILIZE is offered."""
    _step(env, np.array([[LifecycleOp.GERMINATE, 0, 0, 0]]))
    slot = env.hosts[0].model.slot(env.slot_ids[0])
    while not (slot.stage is SeedStage.HOLDING and _fossilize_offered(env)):
        _step(env, WAIT)


def _fossilize_offered(env) -> bool:  # type: ignore[no-untyped-def]
    _, masks = env.observe()
    return bool(masks.slot[0, LifecycleOp.ADVANCE, 0])


def test_a_fossilize_the_gate_refuses_is_reported_and_observed() -> None:
    env = small_env(1, episode_epochs=12)
    env.reset()
    env.observe()
    _holding(env)
    metrics = _metrics(env)
    metrics[0, env.slot_columns("contribution")] = 0.0  # not above min_contribution 0
    env.drain_events()

    outcome = env.apply(np.array([[LifecycleOp.ADVANCE, 0, 0, 0]]), metrics)

    assert outcome.refused.tolist() == [True] and outcome.illegal.tolist() == [False]
    refusals = [e for e in env.drain_events() if e.kind == "refused"]
    assert len(refusals) == 1 and "contribution" in refusals[0].reason
    obs, _ = env.observe()
    refused = env.layout["slot0.gate_refused"].start
    assert obs[0, refused].item() == 1.0


def test_a_restored_host_observes_the_refusals_it_had_at_its_snapshot() -> None:
    """Refusals live on each seed's lifecycle, so a snapshot carries them: nothing to forget."""
    env = small_env(1, episode_epochs=12)
    env.reset()
    env.observe()
    _holding(env)
    refused = env.layout["slot0.gate_refused"].start
    metrics = _metrics(env)
    metrics[0, env.slot_columns("contribution")] = 0.0
    env.apply(np.array([[LifecycleOp.ADVANCE, 0, 0, 0]]), metrics)  # refused
    snapshot = HostSnapshot.take(env.hosts[0], env.host_epoch)
    metrics[0, env.slot_columns("contribution")] = 1.0
    outcome = env.apply(np.array([[LifecycleOp.ADVANCE, 0, 0, 0]]), metrics)
    assert outcome.fossilized.tolist() == [True]
    assert env.observe()[0][0, refused].item() == 0.0

    snapshot.restore(env.hosts[0])

    slot = env.hosts[0].model.slot(env.slot_ids[0])
    assert slot.stage is SeedStage.HOLDING and "contribution" in slot.lifecycle.last_refusal
    assert env.observe()[0][0, refused].item() == 1.0


def test_a_seed_whose_gradients_are_not_finite_is_held_back_and_reported_once() -> None:
    env = _ready(1)
    _step(env, np.array([[LifecycleOp.GERMINATE, 0, 0, 0]]))
    _step(env, WAIT)  # -> TRAINING
    env.drain_events()
    slot = env.hosts[0].model.slot(env.slot_ids[0])
    for _ in range(env.config.lifecycle.min_training_epochs + 1):
        metrics = _metrics(env)
        metrics[0, env.slot_columns("grads_finite")] = 0.0
        env.apply(WAIT, metrics)
    assert slot.stage is SeedStage.TRAINING
    refusals = [e for e in env.drain_events() if e.kind == "refused"]
    assert len(refusals) == 1 and "not finite" in refusals[0].reason


def test_rewards_come_back_as_named_components() -> None:
    env = _ready()
    before = _metrics(env)
    outcome = env.apply(np.array([[0, 0, 0, 0], [0, 0, 0, 0]]), before)
    env.train_epoch()
    after = _metrics(env)
    components = env.rewards(before, after, outcome, terminal=True)
    assert {"acc_delta", "terminal", "param_rent"} <= set(components)
    np.testing.assert_allclose(
        components["acc_delta"],
        after[:, env.column("val_acc")] - before[:, env.column("val_acc")],
        rtol=1e-5,
    )


def test_config_errors_name_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"EnvConfig\.host: .*'cnn'.*got 'mlp_host'"):
        EnvConfig(host="mlp_host")
    with pytest.raises(ValueError, match=r"EnvConfig\.reward"):
        EnvConfig(reward="dense")
    with pytest.raises(ValueError, match="episode_epochs"):
        EnvConfig(episode_epochs=1)
    with pytest.raises(ValueError, match="unknown blueprints"):
        EnvConfig(blueprints=("conv_light", "wings"))


def _host_weights(env) -> list[list[np.ndarray]]:  # type: ignore[no-untyped-def]
    return [[p.detach().numpy().copy() for p in h.model.parameters()] for h in env.hosts]


def test_paired_envs_start_from_the_same_weights_and_train_on_the_same_samples() -> None:
    env = small_env(3, episode_epochs=4, pairing=Pairing(paired_envs=True))
    env.reset()
    weights = _host_weights(env)  # after the first epoch: same start, same batches
    for other in weights[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(weights[0], other, strict=True))
    assert env.hosts[0].model is not env.hosts[1].model  # copies, not one host shared


def test_unpaired_envs_draw_their_own_hosts() -> None:
    env = small_env(2, episode_epochs=4)
    env.reset()
    first, second = _host_weights(env)
    assert not all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_cnn_run_offers_widen_unless_the_config_names_blueprints() -> None:
    from esper.kasmina import BLUEPRINTS
    from esper.kasmina.hosts.cnn import CNNHost
    from esper.mdp.env_config import blueprint_names

    host = CNNHost((1, 8, 8), 10, channels=(2, 4, 8))
    assert blueprint_names(EnvConfig(), host) == ("widen",)
    named = EnvConfig(blueprints=("norm", "conv_wide"))
    assert blueprint_names(named, host) == ("norm", "conv_wide")

    class EveryBlueprint(CNNHost):
        default_blueprints = None

    every = blueprint_names(EnvConfig(), EveryBlueprint((1, 8, 8), 10, channels=(2, 4, 8)))
    shapes = [host.slot(s).shape for s in host.slot_ids]
    fitting = [n for n in BLUEPRINTS.names() if any(BLUEPRINTS.get(n).fits(s) for s in shapes)]
    assert every == tuple(fitting) and {"norm", "mlp", "conv_wide", "widen"} <= set(every)


def test_paired_groups_start_from_their_own_hosts_and_train_on_their_own_share() -> None:
    """Two groups of two: alike within a group (same start, same share), not across."""
    env = small_env(4, episode_epochs=4, pairing=Pairing(True, pair_size=2))
    env.reset()
    weights = _host_weights(env)

    def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
        return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

    assert same(weights[0], weights[1]) and same(weights[2], weights[3])
    assert not same(weights[0], weights[2])


def test_a_pair_size_that_does_not_divide_the_envs_names_the_field() -> None:
    from esper.contracts.config_errors import ConfigError

    with pytest.raises(ConfigError, match=r"pairing.*pair_size=4"):
        EnvConfig(n_envs=6, pairing=Pairing(True, pair_size=4))


def test_cuda_graphs_without_a_gpu_says_it_records_nothing() -> None:
    """The setting is accepted anywhere (a config moves between machines), but on hosts
    that are all off the GPU it cannot do anything, and says so once, at the start."""
    with pytest.warns(UserWarning, match="cuda_graphs: no host trains on a GPU here"):
        small_env(2, engine="stacked", cuda_graphs=True)
