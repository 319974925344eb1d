"""Rollouts for PPO: collect into the buffer, then finish (GAE, the normaliser's update).

The rollout loop (:class:`~esper.mdp.rollout.RolloutCollector`) only collects. Learning
from a rollout takes two more things, done once per rollout on the whole buffer: the
advantages (one GAE pass for every env, bootstrapped from the collector's last read) and
the observation normaliser's update from the raw observations of the valid transitions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from esper.contracts.rollout import RolloutSummary
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.rollout import Controller, RolloutCollector, StepHook
from esper.simic.buffer import RolloutBuffer
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.ppo_batch import PPOBatch


class PPOCollector(RolloutCollector):
    """A rollout collector whose rollouts end as PPO batches."""

    def __init__(
        self,
        env: MorphogeneticVecEnv,
        policy: Controller,
        normalizer: RunningObsNormalizer,
        buffer: RolloutBuffer,
        gamma: float,
        gae_lambda: float,
        compile: bool = False,
        policy_threads: int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        super().__init__(env, policy, buffer, normalizer, compile, policy_threads, cuda_graphs)
        self.buffer = buffer
        self.normalizer = normalizer
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        #: Under data parallelism, an all-reduce (sum) over ranks for the normaliser's
        #: per-rollout statistics; None on one process.
        self.reduce_sum: Callable[[Tensor], Tensor] | None = None

    def collect_batch(
        self, rollout: int, on_step: StepHook | None = None, deterministic: bool = False
    ) -> tuple[PPOBatch, RolloutSummary]:
        """One episode in every env, finished for PPO; the batch and the rollout's summary."""
        collected = self.collect(rollout, on_step, deterministic)
        buffer = self.buffer
        with torch.no_grad():
            batch = buffer.finish(collected.bootstrap, self.gamma, self.gae_lambda)
            self.normalizer.update(
                buffer.raw_obs.flatten(0, 1), buffer.valid.flatten(), reduce_sum=self.reduce_sum
            )
        return batch, collected.summary
