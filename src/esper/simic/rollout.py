"""The rollout loop: one episode in every env, one packed device-to-host read per host epoch.

Per host epoch (DESIGN, "One environment step"): the envs train (``run_epoch``), the
observation and masks are built on the device, the policy acts for all envs in one
forward, and a single packed tensor (actions, log-probs, values, host metrics) comes
back to the host. Python then applies the actions, prices the previous transition and
hands a host-side :class:`StepBatch` to the callbacks. Nothing else reads the device.

The reward of the decision taken after epoch ``t`` is known only after epoch ``t + 1``,
so each read also closes the previous transition; the episode's last read carries the
bootstrap value instead of an action.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from esper.contracts.rollout import RolloutSummary, StepBatch
from esper.simic.buffer import RolloutBuffer
from esper.simic.env import MorphogeneticVecEnv, StepOutcome
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.ppo import PPOBatch
from esper.simic.rewards import total
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import ActResult, LSTMState

StepHook = Callable[[StepBatch], None]


class Controller(Protocol):
    """What drives the envs: the PPO policy, or the heuristic baseline."""

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState: ...

    def act(
        self, obs: Tensor, hidden: LSTMState, masks: ActionMasks, deterministic: bool = False
    ) -> ActResult: ...

    def value(self, obs: Tensor, hidden: LSTMState) -> Tensor: ...


N_HEADS = 4


def read_packed(packed: Tensor) -> np.ndarray:
    """The step's one device-to-host transfer, as a float64 numpy array."""
    return np.asarray(packed.tolist(), dtype=np.float64)


@dataclass
class _Pending:
    """A transition whose reward waits for the next epoch's metrics."""

    step: int
    host_epoch: int
    positions: list[int]
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    metrics: np.ndarray
    outcome: StepOutcome
    legal_ops: np.ndarray


class RolloutCollector:
    """Collects one rollout (one episode per env) into a buffer with a policy."""

    def __init__(
        self,
        env: MorphogeneticVecEnv,
        policy: Controller,
        normalizer: RunningObsNormalizer,
        buffer: RolloutBuffer,
        gamma: float,
        gae_lambda: float,
    ) -> None:
        if buffer.n_steps != env.decisions_per_episode or buffer.n_envs != env.n_envs:
            raise ValueError(
                f"buffer is [{buffer.n_envs}, {buffer.n_steps}] but the env needs "
                f"[{env.n_envs}, {env.decisions_per_episode}]"
            )
        self.env = env
        self.policy = policy
        self.normalizer = normalizer
        self.buffer = buffer
        self.gamma = gamma
        self.gae_lambda = gae_lambda

    @torch.no_grad()
    def collect(
        self, rollout: int, on_step: StepHook | None = None, deterministic: bool = False
    ) -> tuple[PPOBatch, RolloutSummary]:
        env, policy, buffer = self.env, self.policy, self.buffer
        device = env.device
        started = time.perf_counter()
        buffer.reset()
        training_s = time.perf_counter()
        env.reset()
        training_s = time.perf_counter() - training_s
        hidden = policy.initial_state(env.n_envs, device)
        reads = 0
        returns = np.zeros(env.n_envs)
        counts = {
            k: np.zeros(env.n_envs, dtype=np.int64) for k in ("germinated", "fossilized", "pruned")
        }
        pending: _Pending | None = None
        columns = len(env.metric_columns())

        for t in range(env.decisions_per_episode):
            raw_obs, masks = env.observe()
            obs = self.normalizer(raw_obs)
            act: ActResult = policy.act(obs, hidden, masks, deterministic=deterministic)
            packed = torch.cat(
                [
                    act.actions.float(),
                    act.log_prob[:, None].float(),
                    act.value[:, None].float(),
                    env.metrics(),
                ],
                dim=1,
            )
            host = read_packed(packed)
            reads += 1
            actions = host[:, :N_HEADS].astype(np.int64)
            log_probs = host[:, N_HEADS]
            values = host[:, N_HEADS + 1]
            metrics = host[:, N_HEADS + 2 : N_HEADS + 2 + columns]
            if pending is not None:
                returns += self._close(pending, metrics, False, rollout, on_step)
            outcome = env.apply(actions, metrics)
            for k in counts:
                counts[k] += getattr(outcome, k)
            positions = buffer.add(
                obs, raw_obs, act.actions, act.log_prob, act.value, masks, hidden, t == 0
            )
            pending = _Pending(
                t,
                env.host_epoch,
                positions,
                actions,
                log_probs,
                values,
                metrics,
                outcome,
                env.legal_op_counts.copy(),
            )
            hidden = act.hidden
            tick = time.perf_counter()
            env.train_epoch()
            training_s += time.perf_counter() - tick

        # The episode's last epoch: one batched critic pass for the bootstrap, one read.
        raw_obs, _ = env.observe()
        bootstrap = policy.value(self.normalizer(raw_obs), hidden)
        host = read_packed(torch.cat([bootstrap[:, None].float(), env.metrics()], dim=1))
        reads += 1
        assert pending is not None
        returns += self._close(pending, host[:, 1:], True, rollout, on_step)
        batch = buffer.finish(bootstrap, self.gamma, self.gae_lambda)
        self.normalizer.update(buffer.raw_obs.flatten(0, 1), buffer.valid.flatten())
        elapsed = time.perf_counter() - started
        final = host[:, 1:]
        summary = RolloutSummary(
            rollout=rollout,
            episode_return=returns,
            final_val_acc=final[:, env.column("val_acc")],
            seeds_germinated=counts["germinated"],
            seeds_fossilized=counts["fossilized"],
            seeds_pruned=counts["pruned"],
            params_added=env.seed_params(),
            env_steps=env.n_envs * env.decisions_per_episode,
            seconds=elapsed,
            seconds_training_hosts=training_s,
            host_reads=reads,
        )
        return batch, summary

    def _close(
        self,
        pending: _Pending,
        after: np.ndarray,
        terminal: bool,
        rollout: int,
        on_step: StepHook | None,
    ) -> np.ndarray:
        """Price ``pending`` with the metrics of the epoch after it; store and report it."""
        env = self.env
        components = env.rewards(pending.metrics, after, pending.outcome, terminal)
        rewards = total(components)
        self.buffer.set_rewards(pending.positions, torch.from_numpy(rewards), terminal)
        if on_step is not None:
            col = env.column
            on_step(
                StepBatch(
                    rollout=rollout,
                    step=pending.step,
                    host_epoch=pending.host_epoch,
                    actions=pending.actions,
                    log_probs=pending.log_probs,
                    values=pending.values,
                    applied=pending.outcome.applied,
                    refused=pending.outcome.refused,
                    illegal=pending.outcome.illegal,
                    rewards=rewards,
                    reward_components=components,
                    train_loss=pending.metrics[:, col("train_loss")],
                    val_loss=pending.metrics[:, col("val_loss")],
                    val_acc=pending.metrics[:, col("val_acc")],
                    next_val_acc=after[:, col("val_acc")],
                    loss_finite=pending.metrics[:, col("loss_finite")] > 0.5,
                    contribution=pending.metrics[:, env.slot_columns("contribution")],
                    seed_params=env.seed_params(),
                    legal_ops=pending.legal_ops,
                    done=np.full(env.n_envs, terminal),
                )
            )
        return rewards
