"""What the rollout loop hands to callbacks: host-side copies, never device tensors.

Every array here came over in the step's single packed device-to-host transfer (or was
known to Python already), so a callback may read, log and keep them freely without
stalling the device. Shapes: ``E`` envs, ``S`` slots, heads in ``HEAD_NAMES`` order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Kinds of :class:`LifecycleEvent`.
EVENT_KINDS: tuple[str, ...] = (
    "germinated",  # a seed was planted (blueprint, blend mode)
    "advanced",  # a seed moved one stage along the success path
    "fossilized",  # a seed joined the host (also reported as "advanced")
    "refused",  # a gate refused an ADVANCE; ``reason`` says why
    "pruned",  # a seed was cut
    "cooldown",  # the clock moved a slot along PRUNED -> EMBARGOED -> RESETTING -> DORMANT
    "rollback",  # the governor restored this env from a snapshot; ``reason`` says why
    "snapshot",  # the governor took a snapshot of this env
    "oom_skip",  # the env ran out of device memory and sat out the rest of an epoch
)


@dataclass(frozen=True)
class LifecycleEvent:
    """Something that happened to one env (and slot) between two reads."""

    kind: str
    env: int
    slot: str = ""
    stage_from: str = ""
    stage_to: str = ""
    blueprint: str = ""
    reason: str = ""
    host_epoch: int = 0

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"LifecycleEvent.kind {self.kind!r} is not one of {EVENT_KINDS}")


@dataclass(frozen=True)
class StepBatch:
    """One completed transition for every env: the decision and what it earned.

    Attributes:
        rollout: index of the rollout (= PPO update) this step belongs to.
        step: decision index within the episode, ``0 .. episode_epochs - 2``.
        host_epoch: host epochs trained when the decision was taken.
        actions: ``[E, 4]`` int, (op, slot, blueprint, blend) chosen.
        log_probs: ``[E]`` log-probability of the chosen action under the policy.
        values: ``[E]`` the critic's estimate at the decision.
        applied: ``[E]`` bool, the op changed a seed (not WAIT, not refused, not illegal).
        refused: ``[E]`` bool, an ADVANCE that a gate refused (a legal no-op).
        illegal: ``[E]`` bool, an op the lifecycle rejected (the masks should prevent it).
        rewards: ``[E]`` total reward of the transition.
        reward_components: named parts of ``rewards``, each ``[E]``.
        train_loss, val_loss, val_acc: ``[E]`` host metrics of the epoch the decision saw.
        next_val_acc: ``[E]`` host validation accuracy after the epoch that followed.
        loss_finite: ``[E]`` bool, every training loss of that epoch was finite.
        contribution: ``[E, S]`` counterfactual contribution of each slot's seed.
        seed_params: ``[E]`` parameters added by seeds after the action.
        legal_ops: ``[E]`` how many ops the mask allowed (a mask statistic).
        done: ``[E]`` bool, the episode ended with this transition.
        stages: ``[E, S]`` int stage of every slot after the epoch that followed.
        events: lifecycle and governor events since the previous batch, in order.
        mask_rates: per head, the fraction of its choices the masks allowed at the decision.
        probes: named ``[E]`` device-computed signals that rode in the packed transfer
            (e.g. the governor's ``panic`` code), read at the epoch that followed.
        active: ``[E]`` bool, the env took this decision; False where the governor had
            just restored it (no transition was stored for it; its reward is 0 here).
    """

    rollout: int
    step: int
    host_epoch: int
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    applied: np.ndarray
    refused: np.ndarray
    illegal: np.ndarray
    rewards: np.ndarray
    reward_components: dict[str, np.ndarray]
    train_loss: np.ndarray
    val_loss: np.ndarray
    val_acc: np.ndarray
    next_val_acc: np.ndarray
    loss_finite: np.ndarray
    contribution: np.ndarray
    seed_params: np.ndarray
    legal_ops: np.ndarray
    done: np.ndarray
    stages: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    events: tuple[LifecycleEvent, ...] = ()
    mask_rates: dict[str, float] = field(default_factory=dict)
    probes: dict[str, np.ndarray] = field(default_factory=dict)
    active: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def n_envs(self) -> int:
        return int(self.actions.shape[0])


@dataclass(frozen=True)
class RolloutSummary:
    """Per-env totals of one finished rollout (one episode in every env).

    Attributes:
        rollout: index of the rollout (= PPO update).
        episode_return: ``[E]`` sum of rewards over the episode.
        final_val_acc: ``[E]`` host validation accuracy at the end of the episode.
        seeds_germinated / seeds_fossilized / seeds_pruned: ``[E]`` int counts.
        params_added: ``[E]`` seed parameters in the final host (fossilized and live).
        env_steps: decisions taken, summed over envs.
        seconds: wall time of the rollout.
        seconds_training_hosts: wall time inside ``run_epoch``.
        packed_transfers: packed device-to-host transfers (``read_packed`` calls) the loop
            made, one per host epoch. A count the loop keeps, not a measurement: tests and
            the telemetry's ``debug`` profile count real host reads with ``HostReadCounter``.
        rollbacks: ``[E]`` governor rollbacks per env during the rollout.
        discarded_transitions: ``[E]`` transitions dropped by those rollbacks.
        stacked_share: share of the rollout's host training predictions trained in a
            stacked group (``EnvConfig.engine="stacked"``); 0 on the per-env engine.
    """

    rollout: int
    episode_return: np.ndarray
    final_val_acc: np.ndarray
    seeds_germinated: np.ndarray
    seeds_fossilized: np.ndarray
    seeds_pruned: np.ndarray
    params_added: np.ndarray
    env_steps: int
    seconds: float
    seconds_training_hosts: float
    packed_transfers: int
    rollbacks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    discarded_transitions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stacked_share: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def host_epochs_per_env(self) -> int:
        """Host epochs each env trained: one per decision plus the episode's last.

        The denominator of every per-step figure about transfers and host reads, so that
        counted and measured figures divide by the same thing and can be compared.
        """
        return self.env_steps // len(self.episode_return) + 1
