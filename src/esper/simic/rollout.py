"""The rollout loop: one episode in every env, one packed device-to-host read per host epoch.

Per host epoch (DESIGN, "One environment step"): the envs train (``run_epoch``), the
observation and masks are built on the device, the policy acts for all envs in one
forward, and a single packed tensor (actions, log-probs, values, host metrics, probe
signals) comes back to the host. Python then closes the previous transition (prices it,
stores the reward, hands a host-side :class:`StepBatch` to the step hook), carries out any
snapshot or rollback the governor asked for, and applies the actions. Nothing else reads
the device.

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

from esper.contracts.actions import N_HEADS
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch
from esper.simic.buffer import RolloutBuffer
from esper.simic.env import MorphogeneticVecEnv, StepOutcome
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.ppo import PPOBatch
from esper.simic.rewards import total
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import ActResult, LSTMState
from esper.tolaria.epoch import EpochResult
from esper.tolaria.snapshot import HostSnapshot

StepHook = Callable[[StepBatch], None]


class Controller(Protocol):
    """What drives the envs: the PPO policy, or the heuristic baseline."""

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState: ...

    def act(
        self, obs: Tensor, hidden: LSTMState, masks: ActionMasks, deterministic: bool = False
    ) -> ActResult: ...

    def value(self, obs: Tensor, hidden: LSTMState) -> Tensor: ...


class Probe(Protocol):
    """A device-side ``[E]`` signal computed from each epoch and read in the packed transfer.

    ``reset()`` is called at the start of each rollout, ``forget(env)`` when that env is
    restored from a snapshot (both optional).
    """

    def __call__(self, result: EpochResult) -> Tensor: ...


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
    mask_rates: dict[str, float]
    active: np.ndarray


@dataclass(frozen=True)
class EnvSnapshot:
    """One env's host at a decision step, and where its transitions stood in the buffer."""

    host: HostSnapshot
    position: int
    step: int


class RolloutCollector:
    """Collects one rollout (one episode per env) into a buffer with a controller."""

    def __init__(
        self,
        env: MorphogeneticVecEnv,
        policy: Controller,
        normalizer: RunningObsNormalizer,
        buffer: RolloutBuffer,
        gamma: float,
        gae_lambda: float,
        compile: bool = False,
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
        #: The controller's act, through torch.compile when asked (one graph for all envs).
        self._act = torch.compile(policy.act) if compile else policy.act
        self.probes: dict[str, Probe] = {}
        #: Under data parallelism, an all-reduce (sum) over ranks for the normaliser's
        #: per-rollout statistics; None on one process.
        self.reduce_sum: Callable[[Tensor], Tensor] | None = None
        #: Episode seeds are ``rollout * seed_stride + seed_offset``: ranks set these so that
        #: their env groups plant seeds from distinct generators.
        self.seed_stride = 1
        self.seed_offset = 0
        self.snapshots: dict[int, EnvSnapshot] = {}
        self._snapshot_requests: set[int] = set()
        self._rollback_requests: dict[int, str] = {}
        self._penalty_due = np.zeros(env.n_envs, dtype=bool)
        self._rollbacks = np.zeros(env.n_envs, dtype=np.int64)
        self._discarded = np.zeros(env.n_envs, dtype=np.int64)

    # ------------------------------------------------------------- governor API
    def add_probe(self, name: str, probe: Probe) -> None:
        """Ride ``probe``'s ``[E]`` signal along in every packed read, as ``StepBatch.probes``."""
        if name in self.probes:
            raise ValueError(f"a probe named {name!r} is already installed")
        self.probes[name] = probe

    def request_snapshot(self, env: int) -> None:
        """Snapshot ``env`` before the next actions are applied."""
        self._check_env(env)
        self._snapshot_requests.add(env)

    def request_rollback(self, env: int, reason: str) -> bool:
        """Restore ``env`` from its latest snapshot before the next actions are applied.

        Returns False (and does nothing) when the env has no snapshot in this rollout.
        """
        self._check_env(env)
        if env not in self.snapshots:
            return False
        self._rollback_requests[env] = reason
        return True

    def _check_env(self, env: int) -> None:
        if not 0 <= env < self.env.n_envs:
            raise IndexError(f"env {env} out of range for {self.env.n_envs} envs")

    # ------------------------------------------------------------------ rollout
    def collect(
        self, rollout: int, on_step: StepHook | None = None, deterministic: bool = False
    ) -> tuple[PPOBatch, RolloutSummary]:
        """One episode in every env; returns the PPO batch and the rollout's summary."""
        env, policy, buffer = self.env, self.policy, self.buffer
        device = env.device
        started = time.perf_counter()
        buffer.reset()
        self.snapshots.clear()
        self._rollback_requests.clear()
        self._penalty_due[:] = False
        self._rollbacks[:] = 0
        self._discarded[:] = 0
        for probe in self.probes.values():
            getattr(probe, "reset", lambda: None)()
        training_s = time.perf_counter()
        env.reset(episode_seed=rollout * self.seed_stride + self.seed_offset)
        training_s = time.perf_counter() - training_s
        hidden = policy.initial_state(env.n_envs, device)
        transfers = 0
        returns = np.zeros(env.n_envs)
        counts = {
            k: np.zeros(env.n_envs, dtype=np.int64) for k in ("germinated", "fossilized", "pruned")
        }
        pending: _Pending | None = None
        n_metrics = len(env.metric_columns())

        with torch.no_grad():
            for t in range(env.decisions_per_episode):
                raw_obs, masks = env.observe()
                obs = self.normalizer(raw_obs)
                acted_from = hidden
                act: ActResult = self._act(obs, hidden, masks, deterministic=deterministic)
                packed = torch.cat(
                    [
                        act.actions.float(),
                        act.log_prob[:, None].float(),
                        act.value[:, None].float(),
                        env.metrics(),
                        self._probe_columns(),
                    ],
                    dim=1,
                )
                host = read_packed(packed)
                transfers += 1
                actions = host[:, :N_HEADS].astype(np.int64)
                metrics = host[:, N_HEADS + 2 : N_HEADS + 2 + n_metrics]
                probes = host[:, N_HEADS + 2 + n_metrics :]
                if pending is not None:
                    returns += self._close(pending, metrics, probes, False, rollout, on_step)
                hidden = act.hidden
                active, hidden = self._carry_out_requests(t, hidden)
                outcome = env.apply(actions, metrics, active)
                for k in counts:
                    counts[k] += getattr(outcome, k)
                positions = buffer.add(
                    obs,
                    raw_obs,
                    act.actions,
                    act.log_prob,
                    act.value,
                    masks,
                    acted_from,
                    t == 0,
                    active=active.tolist(),
                )
                pending = _Pending(
                    step=t,
                    host_epoch=env.host_epoch,
                    positions=positions,
                    actions=actions,
                    log_probs=host[:, N_HEADS],
                    values=host[:, N_HEADS + 1],
                    metrics=metrics,
                    outcome=outcome,
                    legal_ops=env.legal_op_counts.copy(),
                    mask_rates=env.mask_rates(),
                    active=active,
                )
                tick = time.perf_counter()
                env.train_epoch()
                training_s += time.perf_counter() - tick

            # The episode's last epoch: one batched critic pass for the bootstrap, one read.
            raw_obs, _ = env.observe()
            bootstrap = policy.value(self.normalizer(raw_obs), hidden)
            host = read_packed(
                torch.cat([bootstrap[:, None].float(), env.metrics(), self._probe_columns()], dim=1)
            )
            transfers += 1
            assert pending is not None
            final = host[:, 1 : 1 + n_metrics]
            probes = host[:, 1 + n_metrics :]
            returns += self._close(pending, final, probes, True, rollout, on_step)
            batch = buffer.finish(bootstrap, self.gamma, self.gae_lambda)
            self.normalizer.update(
                buffer.raw_obs.flatten(0, 1), buffer.valid.flatten(), reduce_sum=self.reduce_sum
            )
        self._snapshot_requests.clear()
        self._rollback_requests.clear()
        elapsed = time.perf_counter() - started
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
            packed_transfers=transfers,
            rollbacks=self._rollbacks.copy(),
            discarded_transitions=self._discarded.copy(),
        )
        return batch, summary

    def _probe_columns(self) -> Tensor:
        """``[E, P]`` probe signals of the epoch just trained (``[E, 0]`` with none)."""
        result = self.env.result
        assert result is not None
        if not self.probes:
            return result.val_acc.new_zeros(self.env.n_envs, 0)
        return torch.stack([p(result).float() for p in self.probes.values()], dim=1)

    # ---------------------------------------------------------- snapshots, rollbacks
    def _carry_out_requests(self, step: int, hidden: LSTMState) -> tuple[np.ndarray, LSTMState]:
        """Restore the envs the governor asked to roll back, then take requested snapshots.

        Returns which envs act this step (rolled-back ones do not: their action came from
        a state that no longer exists) and the LSTM state to carry on with, where each
        rolled-back env resumes from the state stored at its snapshot's position.
        """
        env, buffer = self.env, self.buffer
        active = np.ones(env.n_envs, dtype=bool)
        for e, reason in sorted(self._rollback_requests.items()):
            snap = self.snapshots[e]
            snap.host.restore(env.hosts[e])
            env.forget_refusals(e)
            self._discarded[e] += buffer.invalidate(e, snap.position)
            self._rollbacks[e] += 1
            self._penalty_due[e] = True
            active[e] = False
            h, c = buffer.hidden_at(e, snap.position)
            hidden = (_set_env(hidden[0], e, h), _set_env(hidden[1], e, c))
            for probe in self.probes.values():
                getattr(probe, "forget", lambda _e: None)(e)
            env.record(
                LifecycleEvent(
                    kind="rollback",
                    env=e,
                    reason=f"{reason}; restored the snapshot of step {snap.step}",
                    host_epoch=env.host_epoch,
                )
            )
        self._rollback_requests.clear()
        for e in sorted(self._snapshot_requests):
            if not active[e]:
                continue
            self.snapshots[e] = EnvSnapshot(
                HostSnapshot.take(env.hosts[e], env.host_epoch), buffer.pos[e], step
            )
            env.record(LifecycleEvent(kind="snapshot", env=e, host_epoch=env.host_epoch))
        self._snapshot_requests.clear()
        return active, hidden

    # ------------------------------------------------------------------ pricing
    def _close(
        self,
        pending: _Pending,
        after: np.ndarray,
        probes: np.ndarray,
        terminal: bool,
        rollout: int,
        on_step: StepHook | None,
    ) -> np.ndarray:
        """Price ``pending`` with the metrics of the epoch after it; store and report it."""
        env = self.env
        penalised = self._penalty_due & pending.active
        components = env.rewards(pending.metrics, after, pending.outcome, terminal, penalised)
        self._penalty_due &= ~pending.active
        components = {k: np.where(pending.active, v, 0.0) for k, v in components.items()}
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
                    stages=env.stages(),
                    events=env.drain_events(),
                    mask_rates=pending.mask_rates,
                    probes={name: probes[:, i] for i, name in enumerate(self.probes)},
                    active=pending.active,
                )
            )
        else:
            env.drain_events()
        return rewards


def _set_env(state: Tensor, env: int, value: Tensor) -> Tensor:
    """``state [layers, E, H]`` with env ``env``'s rows replaced by ``value [layers, H]``."""
    state = state.clone()
    state[:, env] = value
    return state
