"""A transition waiting for its reward, and the host-side :class:`StepBatch` it is reported as.

The reward of the decision taken after epoch ``t`` is known only after epoch ``t + 1``, so
the rollout loop (:mod:`esper.mdp.rollout`) holds each step's host-side facts here until
the next read prices them; then the step hook gets them as one :class:`StepBatch`. Every
field is a host copy from the step's packed transfer or from Python state: building the
report reads nothing from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from esper.contracts.rollout import StepBatch
from esper.mdp.env import MorphogeneticVecEnv, StepOutcome


@dataclass
class PendingTransition:
    """One decision of every env, waiting for the next epoch's metrics to be priced.

    ``positions [E]``: where each env's transition lies in the buffer (-1: the env sat
    this decision out); ``actions [E, 4]``, ``log_probs``, ``values [E]``; ``metrics
    [E, M]``: the env metrics the decision was taken on; ``active [E]`` bool.
    """

    step: int
    host_epoch: int
    positions: list[int]
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    metrics: np.ndarray
    outcome: StepOutcome
    legal_ops: np.ndarray
    mask_rates: dict[str, float]
    active: np.ndarray

    def report(
        self,
        env: MorphogeneticVecEnv,
        rollout: int,
        rewards: np.ndarray,
        components: dict[str, np.ndarray],
        after: np.ndarray,
        terminal: bool,
        probes: dict[str, np.ndarray],
    ) -> StepBatch:
        """The step hook's view of this transition, priced with ``after [E, M]`` (the
        metrics of the epoch that followed it); drains the env's lifecycle events."""
        col = env.column
        metrics = self.metrics
        return StepBatch(
            rollout=rollout,
            step=self.step,
            host_epoch=self.host_epoch,
            actions=self.actions,
            log_probs=self.log_probs,
            values=self.values,
            applied=self.outcome.applied,
            refused=self.outcome.refused,
            illegal=self.outcome.illegal,
            rewards=rewards,
            reward_components=components,
            train_loss=metrics[:, col("train_loss")],
            val_loss=metrics[:, col("val_loss")],
            val_acc=metrics[:, col("val_acc")],
            next_val_acc=after[:, col("val_acc")],
            loss_finite=metrics[:, col("loss_finite")] > 0.5,
            contribution=metrics[:, env.slot_columns("contribution")],
            seed_params=env.seed_params(),
            legal_ops=self.legal_ops,
            done=np.full(env.n_envs, terminal),
            stages=env.stages(),
            events=env.drain_events(),
            mask_rates=self.mask_rates,
            probes=probes,
            active=self.active,
        )
