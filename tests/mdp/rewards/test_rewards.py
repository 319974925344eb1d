"""Reward families: each component's sign and size, totals, sparsity, validation, registry."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from esper.mdp.rewards import (
    REWARDS,
    RewardConfig,
    RewardInputs,
    shaped_reward,
    sparse_reward,
    total,
)

N_ENVS = 3
N_SLOTS = 2
TOL = 1e-6
SHAPED_COMPONENTS = {
    "acc_delta",
    "contribution",
    "param_rent",
    "illegal_op",
    "wasted_op",
    "fossilize",
    "terminal",
    "rollback",
}
SPARSE_COMPONENTS = {"terminal", "illegal_op", "rollback"}


def clean_inputs(**overrides: Any) -> RewardInputs:
    """A non-terminal step of 3 envs x 2 slots where nothing happened, with overrides."""
    flags = np.zeros(N_ENVS, dtype=bool)
    values: dict[str, np.ndarray] = {
        "val_acc": np.full(N_ENVS, 0.5),
        "prev_val_acc": np.full(N_ENVS, 0.5),
        "contribution": np.zeros((N_ENVS, N_SLOTS)),
        "blending": np.zeros((N_ENVS, N_SLOTS), dtype=bool),
        "seed_params": np.zeros(N_ENVS, dtype=np.int64),
        "illegal_op": flags,
        "wasted_op": flags,
        "fossilized": flags,
        "terminal": flags,
        "rollback": flags,
    }
    for name, value in overrides.items():
        values[name] = np.asarray(value, dtype=values[name].dtype)
    return RewardInputs(**values)


def at(*envs: int) -> np.ndarray:
    """``[N_ENVS]`` bool flags, True at ``envs``."""
    out = np.zeros(N_ENVS, dtype=bool)
    out[list(envs)] = True
    return out


def assert_only(components: dict[str, np.ndarray], name: str, expected: list[float]) -> None:
    """``name`` equals ``expected``; every other component is exactly zero."""
    np.testing.assert_allclose(components[name], expected, atol=TOL, rtol=0)
    for other, value in components.items():
        if other != name:
            assert not value.any(), f"{other} should be 0 on this step, got {value}"


# ------------------------------------------------------------------------- shaped


@pytest.mark.parametrize(
    ("component", "inputs", "config", "expected"),
    [
        pytest.param(
            "acc_delta",
            {"val_acc": [0.6, 0.5, 0.45], "prev_val_acc": [0.5, 0.5, 0.5]},
            {"acc_delta_weight": 2.0},
            [0.2, 0.0, -0.1],
            id="acc_delta-is-weighted-change-either-sign",
        ),
        pytest.param(
            "contribution",
            {
                "contribution": [[0.02, 0.03], [0.04, -0.01], [0.5, 0.5]],
                "blending": [[True, True], [False, True], [False, False]],
            },
            {"contribution_weight": 0.5},
            [0.025, -0.005, 0.0],
            id="contribution-sums-blending-slots-only",
        ),
        pytest.param(
            "param_rent",
            {"seed_params": [0, 25_000, 100_000]},
            {"param_budget": 50_000, "param_penalty_weight": 0.2},
            [0.0, -0.1, -0.4],
            id="param_rent-grows-with-size-past-the-budget",
        ),
        pytest.param(
            "illegal_op",
            {"illegal_op": at(1)},
            {"illegal_op_penalty": 0.3},
            [0.0, -0.3, 0.0],
            id="illegal_op-penalty",
        ),
        pytest.param(
            "wasted_op",
            {"wasted_op": at(0, 2)},
            {"wasted_op_penalty": 0.04},
            [-0.04, 0.0, -0.04],
            id="wasted_op-penalty",
        ),
        pytest.param(
            "fossilize",
            {"fossilized": at(2)},
            {"fossilize_bonus": 0.07},
            [0.0, 0.0, 0.07],
            id="fossilize-bonus",
        ),
        pytest.param(
            "terminal",
            {"terminal": at(1), "val_acc": [0.9, 0.8, 0.7], "prev_val_acc": [0.9, 0.8, 0.7]},
            {"terminal_weight": 2.0},
            [0.0, 1.6, 0.0],
            id="terminal-pays-final-accuracy-on-the-last-step-only",
        ),
        pytest.param(
            "rollback",
            {"rollback": at(0)},
            {"rollback_penalty": 0.6},
            [-0.6, 0.0, 0.0],
            id="rollback-penalty",
        ),
    ],
)
def test_shaped_component_has_the_hand_computed_sign_and_size(
    component: str, inputs: dict, config: dict, expected: list[float]
) -> None:
    components = shaped_reward(clean_inputs(**inputs), RewardConfig(**config))
    assert set(components) == SHAPED_COMPONENTS
    assert_only(components, component, expected)


def test_shaped_rent_is_charged_every_step_not_only_at_the_end() -> None:
    config = RewardConfig()
    rent = shaped_reward(clean_inputs(seed_params=[10_000] * N_ENVS), config)["param_rent"]
    expected = -config.param_penalty_weight * 10_000 / config.param_budget
    np.testing.assert_allclose(rent, [expected] * N_ENVS, atol=TOL, rtol=0)
    assert (rent < 0).all()


def test_shaped_components_are_float32_per_env_and_sum_to_the_total() -> None:
    inputs = clean_inputs(
        val_acc=[0.7, 0.4, 0.9],
        prev_val_acc=[0.6, 0.5, 0.9],
        contribution=[[0.02, 0.01], [0.03, 0.0], [0.0, -0.02]],
        blending=[[True, False], [True, True], [False, True]],
        seed_params=[1_000, 60_000, 0],
        illegal_op=at(0),
        wasted_op=at(1),
        fossilized=at(2),
        terminal=at(2),
        rollback=at(1),
    )
    config = RewardConfig()
    components = shaped_reward(inputs, config)
    for value in components.values():
        assert value.dtype == np.float32 and value.shape == (N_ENVS,)
    summed = total(components)
    assert summed.dtype == np.float32
    np.testing.assert_allclose(summed, sum(components.values()), atol=TOL, rtol=0)
    # Env 2, by hand: acc 0, contribution -0.02 weighted, rent 0, fossilize, terminal 0.9.
    env2 = (
        config.contribution_weight * -0.02 + config.fossilize_bonus + config.terminal_weight * 0.9
    )
    np.testing.assert_allclose(summed[2], env2, atol=TOL, rtol=0)


# ------------------------------------------------------------------------- sparse


def test_sparse_pays_zero_on_a_clean_non_terminal_step_whatever_else_happened() -> None:
    busy_but_clean = clean_inputs(
        val_acc=[0.9, 0.1, 0.6],
        contribution=[[0.3, 0.3], [0.2, 0.0], [0.1, 0.1]],
        blending=np.ones((N_ENVS, N_SLOTS), dtype=bool),
        seed_params=[40_000, 80_000, 5],
        wasted_op=at(0, 1, 2),
        fossilized=at(0, 1, 2),
    )
    components = sparse_reward(busy_but_clean, RewardConfig())
    assert set(components) == SPARSE_COMPONENTS
    assert not total(components).any()


def test_sparse_terminal_pays_final_accuracy_minus_rent_for_the_final_size_once() -> None:
    config = RewardConfig(terminal_weight=2.0, param_penalty_weight=0.1, param_budget=50_000)
    inputs = clean_inputs(
        terminal=at(0, 2), val_acc=[0.9, 0.8, 0.7], seed_params=[25_000, 25_000, 0]
    )
    components = sparse_reward(inputs, config)
    # Env 0: 2 * 0.9 - 0.1 * 0.5; env 1 is not terminal; env 2: 2 * 0.7, no seeds.
    assert_only(components, "terminal", [1.75, 0.0, 1.4])


@pytest.mark.parametrize(
    ("field", "component", "penalty"),
    [
        ("illegal_op", "illegal_op", "illegal_op_penalty"),
        ("rollback", "rollback", "rollback_penalty"),
    ],
)
def test_sparse_still_charges_rule_penalties_on_every_step(
    field: str, component: str, penalty: str
) -> None:
    config = RewardConfig()
    components = sparse_reward(clean_inputs(**{field: at(1)}), config)
    assert_only(components, component, [0.0, -getattr(config, penalty), 0.0])


# ---------------------------------------------------------------------- total


def test_total_rejects_empty_and_mismatched_components() -> None:
    with pytest.raises(ValueError, match="no components"):
        total({})
    with pytest.raises(ValueError, match="component 'b' has shape"):
        total({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})


# -------------------------------------------------------------------- registry


def test_registry_holds_the_built_in_families() -> None:
    assert {"shaped", "sparse"} <= set(REWARDS.names())
    assert REWARDS.get("shaped") is shaped_reward
    assert REWARDS.get("sparse") is sparse_reward
    assert REWARDS.group == "esper.rewards"


def test_registry_rejects_a_non_callable_reward() -> None:
    with pytest.raises(TypeError, match="reward 'constant' must be callable"):
        REWARDS.register("constant", 1.0)  # type: ignore[arg-type]
    assert "constant" not in REWARDS


# ---------------------------------------------------------------------- config


WEIGHT_FIELDS = [f.name for f in fields(RewardConfig) if f.name != "param_budget"]


@pytest.mark.parametrize("name", WEIGHT_FIELDS)
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "1"])
def test_bad_weight_is_rejected_naming_the_field(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match=rf"RewardConfig\.{name}: must be a finite number >= 0"):
        RewardConfig(**{name: bad})


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_param_budget_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"RewardConfig\.param_budget: must be an int >= 1"):
        RewardConfig(param_budget=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("prev_val_acc", np.zeros(N_ENVS + 1)),
        ("blending", np.zeros((N_ENVS, N_SLOTS + 1), dtype=bool)),
        ("seed_params", np.zeros((N_ENVS, 1), dtype=np.int64)),
        ("rollback", np.zeros(N_ENVS - 1, dtype=bool)),
    ],
)
def test_input_shape_mismatch_is_rejected_naming_the_field(name: str, bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match=rf"RewardInputs\.{name} must have shape"):
        RewardInputs(**{**vars(clean_inputs()), name: bad})


def test_inputs_of_the_wrong_kind_are_rejected_naming_the_field() -> None:
    base = vars(clean_inputs())
    with pytest.raises(TypeError, match=r"RewardInputs\.terminal must be a bool array"):
        RewardInputs(**{**base, "terminal": np.zeros(N_ENVS)})
    with pytest.raises(TypeError, match=r"RewardInputs\.seed_params must be an integer array"):
        RewardInputs(**{**base, "seed_params": np.zeros(N_ENVS)})
    with pytest.raises(TypeError, match=r"RewardInputs\.val_acc must be a numpy array"):
        RewardInputs(**{**base, "val_acc": [0.5] * N_ENVS})
    with pytest.raises(ValueError, match=r"RewardInputs\.contribution must be \[E, S\]"):
        RewardInputs(**{**base, "contribution": np.zeros(N_ENVS)})


def test_non_finite_or_negative_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"RewardInputs\.val_acc holds non-finite"):
        clean_inputs(val_acc=[0.5, float("nan"), 0.5])
    with pytest.raises(ValueError, match=r"RewardInputs\.seed_params must be >= 0"):
        clean_inputs(seed_params=[0, -1, 0])
