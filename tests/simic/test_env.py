"""MorphogeneticVecEnv applies ops through the lifecycle and prices them."""

from __future__ import annotations

import numpy as np
import pytest

from esper.contracts import BlendMode, LifecycleOp, SeedStage
from esper.simic.env import EnvConfig
from tests.simic.envs import small_env


def _ready(n_envs: int = 2):  # type: ignore[no-untyped-def]
    env = small_env(n_envs, episode_epochs=4)
    env.reset()
    env.observe()
    return env


def _metrics(env) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(env.metrics().tolist())


def test_germinate_plants_the_chosen_blueprint_with_the_chosen_blend() -> None:
    env = _ready()
    bp = env.blueprint_names.index("norm")
    blend = list(env.blend_modes).index(BlendMode.COSINE)
    actions = np.array([[LifecycleOp.GERMINATE, 1, bp, blend], [LifecycleOp.WAIT, 0, 0, 0]])
    outcome = env.apply(actions, _metrics(env))
    slot = env.hosts[0].model.slot(env.slot_ids[1])
    assert slot.stage is SeedStage.GERMINATED
    assert slot.lifecycle.blueprint == "norm" and slot.lifecycle.blend_mode is BlendMode.COSINE
    assert outcome.germinated.tolist() == [True, False]
    assert outcome.applied.tolist() == [True, False]
    assert env.seed_params()[0] > 0 and env.seed_params()[1] == 0


def test_an_op_the_mask_forbids_is_flagged_illegal_and_changes_nothing() -> None:
    env = _ready()
    actions = np.array([[LifecycleOp.PRUNE, 0, 0, 0], [LifecycleOp.ADVANCE, 1, 0, 0]])
    outcome = env.apply(actions, _metrics(env))
    assert outcome.illegal.tolist() == [True, True]
    assert (env.stages() == SeedStage.DORMANT).all()


def test_an_advance_a_gate_refuses_is_reported_and_observed() -> None:
    env = _ready(1)
    env.apply(np.array([[LifecycleOp.GERMINATE, 0, 0, 0]]), _metrics(env))
    env.train_epoch()
    env.observe()
    env.apply(np.array([[LifecycleOp.ADVANCE, 0, 0, 0]]), _metrics(env))  # -> TRAINING
    env.train_epoch()
    env.observe()
    outcome = env.apply(np.array([[LifecycleOp.ADVANCE, 0, 0, 0]]), _metrics(env))
    assert outcome.refused.tolist() == [True]  # min_training_epochs not yet served
    obs, _ = env.observe()
    refused = env.layout["slot0.gate_refused"].start
    assert obs[0, refused].item() == 1.0


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
    with pytest.raises(ValueError, match=r"EnvConfig\.host 'mlp_host'.*cnn"):
        EnvConfig(host="mlp_host")
    with pytest.raises(ValueError, match=r"EnvConfig\.reward"):
        EnvConfig(reward="dense")
    with pytest.raises(ValueError, match="episode_epochs"):
        EnvConfig(episode_epochs=1)
    with pytest.raises(ValueError, match="unknown blueprints"):
        EnvConfig(blueprints=("conv_light", "wings"))
