"""The rollout loop: one episode in every env, one packed device-to-host read per host epoch.

Per host epoch (one environment step): the envs train (``run_epoch``), the observation
and masks are built on the device, the controller acts for all envs in one forward, and
one packed read (:class:`~esper.mdp.step_read.StepRead`: actions, log-probs, values, host
metrics, the panic code) brings to the host everything Python needs. Python then lets
the governor steer (:meth:`Steering.steer`), closes the previous transition (prices it,
stores the reward, hands a host-side :class:`StepBatch` to the step hook), carries out
any restore the governor asked for (:meth:`Steering.carry_out`, keeping the transition
just closed) and applies the actions. Nothing else reads the device.

The reward of the decision taken after epoch ``t`` is known only after epoch ``t + 1``,
so each read also closes the previous transition; the episode's last read carries the
bootstrap value instead of an action.

Collecting is all this loop does: the transitions go to a
:class:`~esper.mdp.transitions.TransitionStore`, and finishing them for learning (GAE,
the normaliser's update) is the learner's business (``esper.simic.ppo_collector``), so an
evaluation runs episodes with neither.
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
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.governor import PANIC_SIGNAL, Governor, Steering
from esper.mdp.pending import PendingTransition
from esper.mdp.recorded_act import RecordedAct
from esper.mdp.rewards import total
from esper.mdp.step_read import StepRead
from esper.mdp.transitions import TransitionStore
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import ActResult, LSTMState, PolicyNetwork
from esper.threads import intra_op_threads
from esper.tolaria.step_graph import own_recorder

StepHook = Callable[[StepBatch], None]
#: How the controller's observation is made from the raw features (a frozen or learning
#: normaliser); None hands the controller the raw features.
ObservationTransform = Callable[[Tensor], Tensor]


class Controller(Protocol):
    """What drives the envs: the PPO policy, or the heuristic baseline."""

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState: ...

    def act(
        self, obs: Tensor, hidden: LSTMState, masks: ActionMasks, deterministic: bool = False
    ) -> ActResult: ...

    def value(self, obs: Tensor, hidden: LSTMState) -> Tensor: ...


@dataclass(frozen=True)
class Collected:
    """A collected rollout: its summary, and the critic's value ``[E]`` (on the device) of
    each env's observation after its last transition, which finishing it for PPO needs."""

    summary: RolloutSummary
    bootstrap: Tensor


class RolloutCollector:
    """Collects one rollout (one episode per env) into a transition store with a controller."""

    def __init__(
        self,
        env: MorphogeneticVecEnv,
        policy: Controller,
        store: TransitionStore,
        normalize: ObservationTransform | None = None,
        compile: bool = False,
        policy_threads: int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if store.n_steps != env.decisions_per_episode or store.n_envs != env.n_envs:
            raise ValueError(
                f"the transition store is [{store.n_envs}, {store.n_steps}] but the env needs "
                f"[{env.n_envs}, {env.decisions_per_episode}]"
            )
        self.env = env
        self.policy = policy
        self.store = store
        self.normalize = normalize
        #: The controller's act (:func:`acting`).
        self._act = acting(policy, compile, cuda_graphs)
        #: Intra-op threads for the controller's act and value on the CPU (None: torch's).
        self.policy_threads = policy_threads
        #: Episode seeds are ``rollout * seed_stride + seed_offset``: ranks set these so that
        #: their env groups plant seeds from distinct generators.
        self.seed_stride = 1
        self.seed_offset = 0
        #: The governor's mechanics (also the control surface a governor is handed).
        self.steering = Steering(env, store)

    @property
    def governor(self) -> Governor | None:
        return self.steering.governor

    def set_governor(self, governor: Governor | None) -> None:
        """Let ``governor`` steer every rollout from now on (None: none does)."""
        self.steering.set_governor(governor)

    def _observe(self, raw_obs: Tensor) -> Tensor:
        return raw_obs if self.normalize is None else self.normalize(raw_obs)

    # ------------------------------------------------------------------ rollout
    def collect(
        self, rollout: int, on_step: StepHook | None = None, deterministic: bool = False
    ) -> Collected:
        """One episode in every env, its transitions written to the store."""
        env, policy, store, steering = self.env, self.policy, self.store, self.steering
        started = time.perf_counter()
        store.reset()
        steering.start(rollout)
        trained_before = (env.predictions_trained, env.predictions_stacked)
        training_s = time.perf_counter()
        env.reset(episode_seed=rollout * self.seed_stride + self.seed_offset)
        training_s = time.perf_counter() - training_s
        hidden = policy.initial_state(env.n_envs, env.device)
        transfers = 0
        returns = np.zeros(env.n_envs)
        counts = {
            k: np.zeros(env.n_envs, dtype=np.int64) for k in ("germinated", "fossilized", "pruned")
        }
        pending: PendingTransition | None = None
        no_fossil = np.zeros(env.n_envs, dtype=bool)  # what the first read closes: nothing

        with torch.no_grad():
            for t in range(env.decisions_per_episode):
                # Observe the epoch just trained and act for every env, on the device.
                raw_obs, masks = env.observe()
                obs = self._observe(raw_obs)
                with intra_op_threads(self.policy_threads):
                    act: ActResult = self._act(obs, hidden, masks, deterministic=deterministic)
                # The step's one device-to-host read.
                read = StepRead.of_decision(act, env.metrics(), steering.panic_code())
                transfers += 1
                # The governor looks at the read; then the previous decision is priced.
                fossilized = no_fossil if pending is None else pending.outcome.fossilized
                steering.steer(t, read.panic, fossilized, acted_from=hidden)
                if pending is not None:
                    penalised = steering.charged & pending.active
                    returns += self._close(pending, read, penalised, False, rollout, on_step)
                # Restores the governor asked for; then the others' actions are applied.
                active, next_hidden = steering.carry_out(
                    act.hidden, None if pending is None else pending.positions
                )
                outcome = env.apply(read.actions, read.metrics, active)
                for k in counts:
                    counts[k] += getattr(outcome, k)
                positions = store.add(
                    obs,
                    raw_obs,
                    act.actions,
                    act.log_prob,
                    act.value,
                    masks,
                    hidden,
                    t == 0,
                    active=active.tolist(),
                )
                pending = PendingTransition(
                    step=t,
                    host_epoch=env.host_epoch,
                    positions=positions,
                    actions=read.actions,
                    log_probs=read.log_probs,
                    values=read.values,
                    metrics=read.metrics,
                    outcome=outcome,
                    legal_ops=env.legal_op_counts.copy(),
                    mask_rates=env.mask_rates(),
                    active=active,
                )
                hidden = next_hidden
                # The next epoch: every env's host trains (the clock ticks after it).
                tick = time.perf_counter()
                env.train_epoch()
                training_s += time.perf_counter() - tick

            # The episode's last epoch: one batched critic pass for the bootstrap, one read.
            raw_obs, _ = env.observe()
            with intra_op_threads(self.policy_threads):
                bootstrap = policy.value(self._observe(raw_obs), hidden)
            last = StepRead.of_last(bootstrap, env.metrics(), steering.panic_code())
            transfers += 1
            assert pending is not None
            nobody = np.zeros(env.n_envs, dtype=bool)  # the last read: nothing to charge
            returns += self._close(pending, last, nobody, True, rollout, on_step)
        elapsed = time.perf_counter() - started
        summary = RolloutSummary(
            rollout=rollout,
            episode_return=returns,
            final_val_acc=last.metrics[:, env.column("val_acc")],
            seeds_germinated=counts["germinated"],
            seeds_fossilized=counts["fossilized"],
            seeds_pruned=counts["pruned"],
            params_added=env.seed_params(),
            env_steps=env.n_envs * env.decisions_per_episode,
            seconds=elapsed,
            seconds_training_hosts=training_s,
            packed_transfers=transfers,
            rollbacks=steering.rollbacks.copy(),
            discarded_transitions=steering.discarded.copy(),
            stacked_share=_share(
                env.predictions_stacked - trained_before[1],
                env.predictions_trained - trained_before[0],
            ),
        )
        return Collected(summary=summary, bootstrap=bootstrap)

    # ------------------------------------------------------------------ pricing
    def _close(
        self,
        pending: PendingTransition,
        after: StepRead,
        penalised: np.ndarray,
        terminal: bool,
        rollout: int,
        on_step: StepHook | None,
    ) -> np.ndarray:
        """Price ``pending`` with the metrics of the epoch after it; store and report it."""
        env = self.env
        components = env.rewards(
            pending.metrics, after.metrics, pending.outcome, terminal, penalised
        )
        components = {k: np.where(pending.active, v, 0.0) for k, v in components.items()}
        rewards = total(components)
        self.store.set_rewards(pending.positions, torch.from_numpy(rewards), terminal)
        if on_step is not None:
            probes = {} if after.panic is None else {PANIC_SIGNAL: after.panic}
            on_step(
                pending.report(env, rollout, rewards, components, after.metrics, terminal, probes)
            )
        else:
            env.drain_events()
        return rewards


def acting(policy: Controller, compile: bool, cuda_graphs: bool) -> Callable[..., ActResult]:
    """``policy``'s act: through torch.compile with ``compile`` (one graph for all envs);
    with ``cuda_graphs``, a :class:`PolicyNetwork`'s recorded where its device records
    (``esper.mdp.recorded_act``); else as it is."""
    if compile:
        return torch.compile(policy.act)
    if cuda_graphs and isinstance(policy, PolicyNetwork):
        recorder = own_recorder(next(policy.parameters()).device)
        if recorder is not None:
            return RecordedAct(policy, recorder)
    return policy.act


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
