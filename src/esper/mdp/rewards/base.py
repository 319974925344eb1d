"""What a reward function sees, how it is weighted, and the shape of what it returns.

Rewards are computed on the host, after the step's single packed device-to-host
transfer: the inputs are small numpy arrays (``E`` envs, ``S`` slots), so plain numpy is
both the cheapest and the clearest tool. A reward function returns *named components*
rather than one number so telemetry can show which term drives the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np

from esper.contracts.config_errors import owned_by, require_int, require_number

#: dtype of every reward component: what the rollout buffer stores.
REWARD_DTYPE = np.float32

#: numpy dtype kinds accepted per field kind: floating, bool, integer.
_FLOAT_KINDS = frozenset("f")
_BOOL_KINDS = frozenset("b")
_INT_KINDS = frozenset("iu")
_KIND_NAMES = {"f": "a floating", "b": "a bool", "iu": "an integer"}
#: Per-slot fields are ``[E, S]``.
_SLOT_FIELD_NDIM = 2


@dataclass(frozen=True)
class RewardInputs:
    """One step's host-side facts for ``E`` envs with ``S`` slots each.

    Attributes:
        val_acc: ``[E]`` float, validation accuracy after this step (fraction in [0, 1]).
        prev_val_acc: ``[E]`` float, validation accuracy before it.
        contribution: ``[E, S]`` float, ``val_acc`` minus the accuracy with that slot's
            seed switched off (its counterfactual contribution).
        blending: ``[E, S]`` bool, the slot holds a BLENDING/HOLDING seed, whose
            contribution counts toward the reward.
        seed_params: ``[E]`` int, parameters that seeds add to the host, fossilized ones
            included.
        illegal_op: ``[E]`` bool, the op was one the mask should have forbidden, or failed.
        wasted_op: ``[E]`` bool, a legal op that did nothing (e.g. an ADVANCE refused by
            a gate).
        fossilized: ``[E]`` bool, a seed fossilized this step.
        terminal: ``[E]`` bool, the last step of the episode.
        rollback: ``[E]`` bool, the governor rolled this env back this step.
    """

    val_acc: np.ndarray
    prev_val_acc: np.ndarray
    contribution: np.ndarray
    blending: np.ndarray
    seed_params: np.ndarray
    illegal_op: np.ndarray
    wasted_op: np.ndarray
    fossilized: np.ndarray
    terminal: np.ndarray
    rollback: np.ndarray

    @property
    def n_envs(self) -> int:
        return int(self.val_acc.shape[0])

    @property
    def n_slots(self) -> int:
        return int(self.contribution.shape[1])

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"RewardInputs.{f.name} must be a numpy array, got {type(value).__name__}; "
                    "convert it with np.asarray"
                )
        if self.val_acc.ndim != 1:
            raise ValueError(
                f"RewardInputs.val_acc must be [E] (one per env), got shape {self.val_acc.shape}"
            )
        if self.contribution.ndim != _SLOT_FIELD_NDIM:
            raise ValueError(
                "RewardInputs.contribution must be [E, S] (envs x slots), "
                f"got shape {self.contribution.shape}"
            )
        n_envs, n_slots = self.n_envs, self.contribution.shape[1]
        expected: dict[str, tuple[tuple[int, ...], frozenset[str]]] = {
            "val_acc": ((n_envs,), _FLOAT_KINDS),
            "prev_val_acc": ((n_envs,), _FLOAT_KINDS),
            "contribution": ((n_envs, n_slots), _FLOAT_KINDS),
            "blending": ((n_envs, n_slots), _BOOL_KINDS),
            "seed_params": ((n_envs,), _INT_KINDS),
            "illegal_op": ((n_envs,), _BOOL_KINDS),
            "wasted_op": ((n_envs,), _BOOL_KINDS),
            "fossilized": ((n_envs,), _BOOL_KINDS),
            "terminal": ((n_envs,), _BOOL_KINDS),
            "rollback": ((n_envs,), _BOOL_KINDS),
        }
        for name, (shape, kinds) in expected.items():
            value: np.ndarray = getattr(self, name)
            if value.shape != shape:
                raise ValueError(
                    f"RewardInputs.{name} must have shape {shape} for E={n_envs} envs and "
                    f"S={n_slots} slots (taken from val_acc and contribution), got {value.shape}"
                )
            if value.dtype.kind not in kinds:
                kind = _KIND_NAMES["".join(sorted(kinds))]
                raise TypeError(
                    f"RewardInputs.{name} must be {kind} array, got dtype {value.dtype}"
                )
            if kinds is _FLOAT_KINDS and not np.isfinite(value).all():
                raise ValueError(
                    f"RewardInputs.{name} holds non-finite values; a NaN here would poison "
                    "every advantage of the rollout"
                )
        if (self.seed_params < 0).any():
            raise ValueError("RewardInputs.seed_params must be >= 0 (a count of parameters)")


@dataclass(frozen=True)
class RewardConfig:
    """Weights of the reward terms. Every penalty is given as a magnitude (>= 0).

    The scale is set by accuracy, a fraction in [0, 1]: one percentage point of
    validation accuracy gained is worth ``0.01 * acc_delta_weight``.

    The defaults keep the one rule every family keeps: the episode return ranks
    outcomes as the final accuracy does, then by parameters added. Accuracy enters only
    through terms that telescope to the final figure (``acc_delta``) or pay it
    (``terminal``); the parameter rent over a whole episode at the full budget is
    smaller than one validation image of accuracy on the default data, so it breaks ties
    and never outweighs accuracy. ``contribution_weight`` and ``fossilize_bonus`` are
    off: they paid for what the counterfactual measured (how much a host had come to
    lean on its seed), not for what the final host kept, and a controller that lost
    accuracy out-earned no growth with them (benchmarks/README.md, "Design figures kept out of docstrings").

    Attributes:
        acc_delta_weight: weight of each step's change in validation accuracy (shaped
            family); over an episode it adds up to final minus initial accuracy.
        contribution_weight: weight of the summed counterfactual contribution of blending
            and holding seeds (shaped family); a shaping term, best left at 0.
        param_budget: seed parameters an env may hold: GERMINATE is offered only for
            blueprints that fit under it, and the rent reaches param_penalty_weight there.
        param_penalty_weight: parameter rent for seeds as large as param_budget, per step
            (shaped) or once at the end (sparse); keep it small so it only breaks ties.
        illegal_op_penalty: charged when an op was one the mask should have forbidden,
            or it failed.
        wasted_op_penalty: charged for a legal op that did nothing, such as a refused
            FOSSILIZE (shaped family).
        fossilize_bonus: paid when a seed fossilizes (shaped family); the accuracy terms
            already pay for what it adds, so best left at 0.
        terminal_weight: weight of the final validation accuracy, paid on the episode's
            last step.
        rollback_penalty: charged when the governor rolls an env back, so the policy
            learns to avoid panics.
    """

    #: Weight of the step's change in validation accuracy (telescopes to final - initial).
    acc_delta_weight: float = 1.0
    #: Weight of the summed counterfactual contribution of blending/holding seeds: a
    #: shaping term that pays for co-adaptation as much as for help, so 0 by default.
    contribution_weight: float = 0.0
    #: Seed parameters at which the rent reaches ``param_penalty_weight`` per step.
    param_budget: int = 50_000
    #: Rent per step for seeds as large as the budget. At 1e-4, a full budget held for a
    #: whole 25-epoch episode costs 0.0025: less than one image of accuracy on the digits
    #: validation split (1/360, paid twice: acc_delta and terminal), so it only breaks ties.
    param_penalty_weight: float = 1e-4
    #: Charged when the op was one the mask should have forbidden (or it failed).
    illegal_op_penalty: float = 0.01
    #: Charged for a legal op that did nothing, such as a FOSSILIZE refused for too small
    #: a contribution (refusals for time cannot happen: those actions are masked).
    wasted_op_penalty: float = 0.001
    #: Paid when a seed fossilizes. 0 by default: fossilizing is worth what it adds to
    #: the final accuracy, which the accuracy terms already pay.
    fossilize_bonus: float = 0.0
    #: Weight of the final validation accuracy paid on the episode's last step.
    terminal_weight: float = 1.0
    #: Charged when the governor rolls an env back, so the policy learns to avoid panics.
    rollback_penalty: float = 0.5

    def __post_init__(self) -> None:
        with owned_by(self):
            for f in fields(self):
                if f.name != "param_budget":
                    require_number(f.name, getattr(self, f.name), at_least=0.0)
            require_int(
                "param_budget",
                self.param_budget,
                1,
                hint="it counts the seed parameters an env may hold",
            )


class RewardFn(Protocol):
    """A reward family: named ``[E]`` float32 components for one step of every env."""

    def __call__(self, inputs: RewardInputs, config: RewardConfig) -> dict[str, np.ndarray]: ...


def total(components: Mapping[str, np.ndarray]) -> np.ndarray:
    """``[E]`` float32 sum of a reward function's components (what PPO is trained on)."""
    if not components:
        raise ValueError("total: a reward function returned no components")
    arrays = list(components.values())
    out = np.zeros(arrays[0].shape, dtype=REWARD_DTYPE)
    for name, value in components.items():
        if value.shape != out.shape:
            raise ValueError(
                f"total: component {name!r} has shape {value.shape}, others {out.shape}"
            )
        out += value
    return out


def param_rent(inputs: RewardInputs, config: RewardConfig) -> np.ndarray:
    """``[E]`` float64 rent (>= 0) for the seeds' current size: proportional, uncapped."""
    return config.param_penalty_weight * inputs.seed_params / config.param_budget


def flag_penalty(flags: np.ndarray, penalty: float) -> np.ndarray:
    """``[E]`` float32: ``-penalty`` where ``flags`` is set, 0 elsewhere."""
    return np.where(flags, -penalty, 0.0).astype(REWARD_DTYPE)
