"""The rollout loop: one episode in every env, one packed device-to-host read per host epoch.

Per host epoch (one environment step): the envs train (``run_epoch``), the
observation and masks are built on the device, the policy acts for all envs in one
forward, and a single packed tensor (actions, log-probs, values, host metrics, the panic
signal) comes back to the host. Python then lets the governor steer, closes the previous
transition (prices it, stores the reward, hands a host-side :class:`StepBatch` to the step
hook), carries out any restore the governor asked for (keeping, for PPO, the transition
just closed), and applies the actions. Nothing else reads the device.

A governor (:class:`~esper.simic.control.Governor`, e.g. ``esper.callbacks.GovernorCallback``)
owns its policy and its snapshots; this loop carries out what it asks through the control
surface of :mod:`esper.simic.control`: :meth:`RolloutCollector.snapshot`,
:meth:`~RolloutCollector.request_restore` and :meth:`~RolloutCollector.penalise`.

The reward of the decision taken after epoch ``t`` is known only after epoch ``t + 1``,
so each read also closes the previous transition; the episode's last read carries the
bootstrap value instead of an action.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from esper.contracts.actions import N_HEADS
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch
from esper.simic.buffer import RolloutBuffer
from esper.simic.control import PANIC_SIGNAL, EnvSnapshot, Governor, GovernorRead, PanicDetector
from esper.simic.env import MorphogeneticVecEnv
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.pending import PendingTransition
from esper.simic.ppo_batch import PPOBatch
from esper.simic.rewards import total
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import ActResult, LSTMState
from esper.threads import intra_op_threads
from esper.tolaria.snapshot import HostSnapshot

StepHook = Callable[[StepBatch], None]


class Controller(Protocol):
    """What drives the envs: the PPO policy, or the heuristic baseline."""

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState: ...

    def act(
        self, obs: Tensor, hidden: LSTMState, masks: ActionMasks, deterministic: bool = False
    ) -> ActResult: ...

    def value(self, obs: Tensor, hidden: LSTMState) -> Tensor: ...


def read_packed(packed: Tensor) -> np.ndarray:
    """The step's one device-to-host transfer, as a float64 numpy array."""
    return np.asarray(packed.tolist(), dtype=np.float64)


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
        policy_threads: int | None = None,
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
        #: Intra-op threads for the controller's act and value on the CPU (None: torch's).
        self.policy_threads = policy_threads
        #: Under data parallelism, an all-reduce (sum) over ranks for the normaliser's
        #: per-rollout statistics; None on one process.
        self.reduce_sum: Callable[[Tensor], Tensor] | None = None
        #: Episode seeds are ``rollout * seed_stride + seed_offset``: ranks set these so that
        #: their env groups plant seeds from distinct generators.
        self.seed_stride = 1
        self.seed_offset = 0
        self.governor: Governor | None = None
        self._detector: PanicDetector | None = None
        self._restores: dict[int, EnvSnapshot] = {}
        #: The LSTM state the envs acted from at the current read (what a snapshot keeps).
        self._acted_from: LSTMState | None = None
        #: Per env, positions below this hold a kept transition or what precedes it: a
        #: later restore (to the same snapshot) drops nothing below it.
        self._settled = np.zeros(env.n_envs, dtype=np.int64)
        self._charged = np.zeros(env.n_envs, dtype=bool)
        self._steering = False
        self._rollout = self._step = 0
        self._rollbacks = np.zeros(env.n_envs, dtype=np.int64)
        self._discarded = np.zeros(env.n_envs, dtype=np.int64)

    # ----------------------------------------------------------- control surface
    def set_governor(self, governor: Governor | None) -> None:
        """Let ``governor`` steer every rollout from now on (None: none does)."""
        self.governor = governor
        env = self.env
        self._detector = (
            None if governor is None else PanicDetector(governor.panic, env.n_envs, env.device)
        )

    def snapshot(self, env: int) -> EnvSnapshot:
        """A copy of ``env``'s host and of the LSTM state it acts from now (device-to-device),
        to restore both later. Only from :meth:`Governor.steer`, and not of an env whose
        restore this read requested (its state is about to be replaced)."""
        self._check_env(env)
        if not self._steering or self._acted_from is None:
            raise RuntimeError("snapshot() is only valid inside Governor.steer()")
        if env in self._restores:
            raise ValueError(f"env {env} is being restored at this read: no snapshot of it")
        e = self.env
        host = HostSnapshot.take(e.hosts[env], e.host_epoch)
        e.record(LifecycleEvent(kind="snapshot", env=env, host_epoch=e.host_epoch))
        hidden = (self._acted_from[0][:, env].clone(), self._acted_from[1][:, env].clone())
        return EnvSnapshot(host, hidden, self.buffer.pos[env], self._step, self._rollout)

    def request_restore(self, env: int, snapshot: EnvSnapshot, reason: str) -> None:
        """Restore ``env`` from ``snapshot`` (of this rollout) before the next actions.

        That env alone drops its transitions since the snapshot but the one this read
        closes (the transition whose epoch was judged, kept with its reward and penalty
        as the last before the restore), resumes the policy state it had at the snapshot,
        forgets its panic history and sits out this decision (its action was chosen from
        a state that no longer exists).
        """
        self._check_env(env)
        if snapshot.rollout != self._rollout or env in self._restores:
            raise ValueError(
                f"env {env}: a restore needs a snapshot of this rollout ({self._rollout}, "
                f"got {snapshot.rollout}) and at most one request per read"
            )
        self._restores[env] = snapshot
        reason = f"{reason}; restored the snapshot of step {snapshot.step}"
        e = self.env
        e.record(LifecycleEvent(kind="rollback", env=env, reason=reason, host_epoch=e.host_epoch))

    def penalise(self, env: int) -> None:
        """Charge ``env`` the rollback penalty on the transition this read closes: the one
        whose epoch the governor judged (none where the env sat that decision out).

        Only from :meth:`Governor.steer`, before that transition is priced.
        """
        self._check_env(env)
        if not self._steering:
            raise RuntimeError("penalise() is only valid inside Governor.steer()")
        self._charged[env] = True

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
        self._restores.clear()
        self._rollout = rollout
        self._rollbacks[:] = 0
        self._discarded[:] = 0
        self._settled[:] = 0
        if self._detector is not None:
            self._detector.reset()
        training_s = time.perf_counter()
        env.reset(episode_seed=rollout * self.seed_stride + self.seed_offset)
        training_s = time.perf_counter() - training_s
        hidden = policy.initial_state(env.n_envs, device)
        transfers = 0
        returns = np.zeros(env.n_envs)
        counts = {
            k: np.zeros(env.n_envs, dtype=np.int64) for k in ("germinated", "fossilized", "pruned")
        }
        pending: PendingTransition | None = None
        n_metrics = len(env.metric_columns())

        with torch.no_grad():
            for t in range(env.decisions_per_episode):
                raw_obs, masks = env.observe()
                obs = self.normalizer(raw_obs)
                acted_from = hidden
                with intra_op_threads(self.policy_threads):
                    act: ActResult = self._act(obs, hidden, masks, deterministic=deterministic)
                packed = torch.cat(
                    [
                        act.actions.float(),
                        act.log_prob[:, None].float(),
                        act.value[:, None].float(),
                        env.metrics(),
                        self._panic_column(),
                    ],
                    dim=1,
                )
                host = read_packed(packed)
                transfers += 1
                actions = host[:, :N_HEADS].astype(np.int64)
                metrics = host[:, N_HEADS + 2 : N_HEADS + 2 + n_metrics]
                probes = host[:, N_HEADS + 2 + n_metrics :]
                self._steer(t, probes, pending, acted_from)
                if pending is not None:
                    returns += self._close(pending, metrics, probes, False, rollout, on_step)
                hidden = act.hidden
                active, hidden = self._carry_out_restores(hidden, pending)
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
                pending = PendingTransition(
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
            with intra_op_threads(self.policy_threads):
                bootstrap = policy.value(self.normalizer(raw_obs), hidden)
            host = read_packed(
                torch.cat([bootstrap[:, None].float(), env.metrics(), self._panic_column()], dim=1)
            )
            transfers += 1
            assert pending is not None
            final = host[:, 1 : 1 + n_metrics]
            probes = host[:, 1 + n_metrics :]
            self._charged[:] = False  # the last read: no restore, nothing to charge
            returns += self._close(pending, final, probes, True, rollout, on_step)
            batch = buffer.finish(bootstrap, self.gamma, self.gae_lambda)
            self.normalizer.update(
                buffer.raw_obs.flatten(0, 1), buffer.valid.flatten(), reduce_sum=self.reduce_sum
            )
        self._restores.clear()
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

    def _panic_column(self) -> Tensor:
        """``[E, 1]`` panic code of the epoch just trained (``[E, 0]`` with no governor)."""
        result = self.env.result
        assert result is not None
        if self._detector is None:
            return result.val_acc.new_zeros(self.env.n_envs, 0)
        return self._detector(result).float()[:, None]

    # ------------------------------------------------------------- governor
    def _steer(
        self,
        step: int,
        signals: np.ndarray,
        pending: PendingTransition | None,
        acted_from: LSTMState,
    ) -> None:
        """Let the governor act on this read before the transition it closes is priced."""
        self._charged[:] = False
        self._step = step
        if self.governor is None:
            return
        n = self.env.n_envs
        fossilized = np.zeros(n, dtype=bool) if pending is None else pending.outcome.fossilized
        read = GovernorRead(step, self.env.host_epoch, signals[:, 0], fossilized)
        self._steering, self._acted_from = True, acted_from
        try:
            self.governor.steer(self, read)
        finally:
            self._steering = False
            self._acted_from = None

    def _carry_out_restores(
        self, hidden: LSTMState, pending: PendingTransition | None
    ) -> tuple[np.ndarray, LSTMState]:
        """Restore the envs the governor asked for; which envs act now, and the LSTM state.

        Each restored env keeps the transition this read closed (just priced: the one
        whose epoch was judged), moved down to the first position it drops; restored envs
        do not act this step, and each resumes from the policy state its snapshot kept.
        Their refusal flags come back with the host: they live on each seed's lifecycle.
        """
        env, buffer = self.env, self.buffer
        active = np.ones(env.n_envs, dtype=bool)
        for e, snap in sorted(self._restores.items()):
            snap.host.restore(env.hosts[e])
            start = max(snap.position, int(self._settled[e]))
            keep = None if pending is None or pending.positions[e] < 0 else pending.positions[e]
            self._discarded[e] += buffer.invalidate(e, start, keep)
            if keep is not None:
                self._settled[e] = buffer.pos[e]
            self._rollbacks[e] += 1
            active[e] = False
            hidden = (
                _set_env(hidden[0], e, snap.hidden[0]),
                _set_env(hidden[1], e, snap.hidden[1]),
            )
            if self._detector is not None:
                self._detector.forget(e)
        self._restores.clear()
        return active, hidden

    # ------------------------------------------------------------------ pricing
    def _close(
        self,
        pending: PendingTransition,
        after: np.ndarray,
        signals: np.ndarray,
        terminal: bool,
        rollout: int,
        on_step: StepHook | None,
    ) -> np.ndarray:
        """Price ``pending`` with the metrics of the epoch after it; store and report it."""
        env = self.env
        penalised = self._charged & pending.active
        components = env.rewards(pending.metrics, after, pending.outcome, terminal, penalised)
        components = {k: np.where(pending.active, v, 0.0) for k, v in components.items()}
        rewards = total(components)
        self.buffer.set_rewards(pending.positions, torch.from_numpy(rewards), terminal)
        if on_step is not None:
            probes = {} if self._detector is None else {PANIC_SIGNAL: signals[:, 0]}
            on_step(pending.report(env, rollout, rewards, components, after, terminal, probes))
        else:
            env.drain_events()
        return rewards


def _set_env(state: Tensor, env: int, value: Tensor) -> Tensor:
    """``state [layers, E, H]`` with env ``env``'s rows replaced by ``value [layers, H]``."""
    state = state.clone()
    state[:, env] = value
    return state
