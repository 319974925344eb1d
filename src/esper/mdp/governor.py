"""The governor on the rollout: the panic signal it reads, what it may ask, and how it is done.

A :class:`Governor` (``esper.callbacks.GovernorCallback``) owns the policy (when to
snapshot, when to restore, whom to charge) and keeps its snapshots. :class:`Steering`
owns the mechanics, which the rollout loop calls at two points of each step:
:meth:`Steering.steer` right after the step's read (the governor decides) and
:meth:`Steering.carry_out` before the actions are applied (restores happen). Between
governor and loop sits this surface:

* the **panic signal**: an env panics when its training loss is not finite, or rises more
  than ``sigma`` standard deviations above that env's recent history. A
  :class:`PanicDetector` tests all envs at once on the device with the governor's
  :class:`PanicConfig`; its ``[E]`` code rides in the step's packed transfer, so the
  governor reads it host-side (:class:`GovernorRead`, ``StepBatch.probes["panic"]``)
  without an extra read;
* :class:`RolloutControl` (:class:`Steering` implements it): ``snapshot(env)``,
  ``request_restore(env, snapshot, reason)`` and ``penalise(env)``, each about one env.

A restore keeps the transition the read closes (the one whose epoch was judged), with
its reward and any penalty, as the last before the restore; only the env's transitions
between the snapshot and it are dropped. So the penalty reaches PPO, and GAE reads that
transition as leading back to the snapshot's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from esper.contracts.config_errors import ConfigError, owned_by, require_int, require_number
from esper.contracts.rollout import LifecycleEvent
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.transitions import TransitionStore
from esper.tamiyo.policy import LSTMState
from esper.tolaria.copies import Copies
from esper.tolaria.epoch import EpochResult
from esper.tolaria.snapshot import HostSnapshot

#: The name of the panic signal in ``StepBatch.probes``.
PANIC_SIGNAL = "panic"

#: Codes of the detector's ``[E]`` signal.
PANIC_NONE = 0.0
PANIC_SPIKE = 1.0
PANIC_NONFINITE = 2.0


@dataclass(frozen=True)
class PanicConfig:
    """When a loss counts as a panic.

    ``sigma``: how many standard deviations above the recent mean; ``window``: how many
    past epochs form the history; ``min_history``: epochs needed before the sigma test
    applies (a fresh host's first losses fall fast and say nothing about stability);
    ``min_std``: floor on the deviation, so a flat history does not flag noise.
    """

    sigma: float = 4.0
    window: int = 8
    min_history: int = 3
    min_std: float = 1e-3

    def __post_init__(self) -> None:
        with owned_by(self):
            require_number("sigma", self.sigma, above=0)
            window = require_int("window", self.window, 2)
            require_int("min_history", self.min_history, 2)
            if self.min_history > window:
                raise ConfigError(
                    "min_history", f"must be at most window={window}, got {self.min_history!r}"
                )
            require_number("min_std", self.min_std, above=0)


class PanicDetector:
    """Per-env ring buffers of recent training losses, on the device."""

    def __init__(self, config: PanicConfig, n_envs: int, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        self.history = torch.zeros(n_envs, config.window, device=self.device)
        self.count = torch.zeros(n_envs, dtype=torch.long, device=self.device)
        #: Per env, the ring position the next kept loss goes to.
        self.head = torch.zeros(n_envs, dtype=torch.long, device=self.device)

    def reset(self) -> None:
        self.history.zero_()
        self.count.zero_()
        self.head.zero_()

    def forget(self, env: int) -> None:
        """Clear one env's history (after it was restored to an older state)."""
        self.history[env].zero_()
        self.count[env].zero_()
        self.head[env].zero_()

    def __call__(self, result: EpochResult) -> Tensor:
        """``[E]`` panic code of this epoch (see ``PANIC_*``); updates the history."""
        cfg = self.config
        loss = result.train_loss
        filled = self.count.clamp(max=cfg.window)  # [E]
        slots = torch.arange(cfg.window, device=self.device)
        # Ring positions hold data where their age is below the env's count.
        age = (self.head[:, None] - 1 - slots[None, :]) % cfg.window  # [E, W]
        held = (age < filled[:, None]).float()
        n = held.sum(dim=1).clamp(min=1)
        mean = (self.history * held).sum(dim=1) / n
        var = (((self.history - mean[:, None]) ** 2) * held).sum(dim=1) / n
        std = var.sqrt().clamp(min=cfg.min_std)
        spike = (filled >= cfg.min_history) & (loss > mean + cfg.sigma * std)
        finite = result.loss_finite & torch.isfinite(loss)
        panic = ~finite | spike
        # Only calm, finite losses enter the history.
        keep = ~panic
        at = self.head[:, None]
        old = self.history.gather(1, at).squeeze(1)
        self.history.scatter_(1, at, torch.where(keep, loss, old)[:, None])
        self.count += keep.long()
        self.head = (self.head + keep.long()) % cfg.window
        return torch.where(
            ~finite,
            torch.full_like(loss, PANIC_NONFINITE),
            torch.where(
                spike, torch.full_like(loss, PANIC_SPIKE), torch.full_like(loss, PANIC_NONE)
            ),
        )


@dataclass(frozen=True)
class EnvSnapshot:
    """One env's host at a decision step of a rollout, and where its transitions stood.

    ``hidden``: the policy's LSTM state the env acted from at that step, ``(h, c)`` each
    ``[layers, H]`` (device copies), which a restore resumes from; kept here rather than
    read from the buffer, where a kept transition may overwrite it.
    """

    host: HostSnapshot
    hidden: tuple[Tensor, Tensor]
    position: int
    step: int
    rollout: int


@dataclass(frozen=True)
class GovernorRead:
    """What the governor learns at a read, all host-side (it came in the packed transfer).

    ``step``: the decision about to be taken (the read closes decision ``step - 1``);
    ``host_epoch``: host epochs trained; ``panic``: ``[E]`` ``PANIC_*`` code of the epoch
    just trained; ``fossilized``: ``[E]`` bool, decision ``step - 1`` fossilized a seed.
    """

    step: int
    host_epoch: int
    panic: np.ndarray
    fossilized: np.ndarray

    @property
    def n_envs(self) -> int:
        return int(self.panic.shape[0])


class RolloutControl(Protocol):
    """What a governor may ask of the rollout, one env at a time."""

    def snapshot(self, env: int) -> EnvSnapshot:
        """A copy of ``env``'s host and of the LSTM state it acts from now (device-to-device),
        to restore both later. Its tensors are filled as ``Governor.steer`` returns (every
        snapshot of a read in a few multi-tensor copies): read them after, not during."""
        ...

    def request_restore(self, env: int, snapshot: EnvSnapshot, reason: str) -> None:
        """Restore ``env`` from ``snapshot`` before the next actions; it drops that env's
        transitions since the snapshot but the one this read closes (kept as the last
        before the restore), and nothing of any other env."""
        ...

    def penalise(self, env: int) -> None:
        """Charge ``env`` the rollback penalty on the transition this read closes."""
        ...


@runtime_checkable
class Governor(Protocol):
    """Steers the rollout per env: when to snapshot, when to restore, whom to charge.

    ``panic`` configures the panic test the rollout runs on the device for it. ``steer``
    runs at every read but the episode's last (nothing is left to save then), after the
    read and before the transition it closes is priced, so a penalty lands on the very
    transition whose epoch panicked.
    """

    panic: PanicConfig

    def steer(self, control: RolloutControl, read: GovernorRead) -> None: ...


class Steering:
    """Carries out what a governor asks, for one env group and its transition store.

    Per rollout: :meth:`start`; per read, :meth:`steer` (the governor looks at the read
    and may snapshot, request restores and charge penalties) and, once that read's
    transition is priced, :meth:`carry_out` (the requested restores). Without a governor
    both do nothing and the panic column is empty.
    """

    def __init__(self, env: MorphogeneticVecEnv, store: TransitionStore) -> None:
        self.env, self.store = env, store
        self.governor: Governor | None = None
        self._detector: PanicDetector | None = None
        self._restores: dict[int, EnvSnapshot] = {}
        #: The LSTM state the envs acted from at the current read (what a snapshot keeps).
        self._acted_from: LSTMState | None = None
        n = env.n_envs
        #: Per env, positions below this hold a kept transition or what precedes it: a
        #: later restore (to the same snapshot) drops nothing below it.
        self._settled = np.zeros(n, dtype=np.int64)
        #: Per env, charged the rollback penalty at this read.
        self.charged = np.zeros(n, dtype=bool)
        self._steering = False
        #: The copies of the snapshots taken at the current read, run as it ends.
        self._copies = Copies()
        self._rollout = self._step = 0
        #: Per env, restores and dropped transitions in this rollout.
        self.rollbacks = np.zeros(n, dtype=np.int64)
        self.discarded = np.zeros(n, dtype=np.int64)

    def set_governor(self, governor: Governor | None) -> None:
        """Let ``governor`` steer every rollout from now on (None: none does)."""
        self.governor = governor
        env = self.env
        self._detector = (
            None if governor is None else PanicDetector(governor.panic, env.n_envs, env.device)
        )

    def start(self, rollout: int) -> None:
        """Forget the previous rollout: no restores, counts at zero, panic history empty."""
        self._restores.clear()
        self._rollout = rollout
        self.rollbacks[:] = 0
        self.discarded[:] = 0
        self._settled[:] = 0
        self.charged[:] = False
        if self._detector is not None:
            self._detector.reset()

    def panic_code(self) -> Tensor | None:
        """``[E]`` panic code of the epoch just trained (on the device); None without a
        governor. Updates the detector's history: once per read."""
        if self._detector is None:
            return None
        result = self.env.result
        assert result is not None
        return self._detector(result)

    # ------------------------------------------------------------- point 1: the read
    def steer(
        self,
        step: int,
        panic: np.ndarray | None,
        fossilized: np.ndarray,
        acted_from: LSTMState,
    ) -> None:
        """Let the governor act on this read, before the transition it closes is priced.

        ``fossilized [E]``: the closed decision fossilized a seed; ``acted_from``: the LSTM
        state the envs act from at this read (what a snapshot keeps).
        """
        self.charged[:] = False
        self._step = step
        if self.governor is None:
            return
        assert panic is not None
        read = GovernorRead(step, self.env.host_epoch, panic, fossilized)
        self._steering, self._acted_from = True, acted_from
        self._copies = Copies()
        try:
            self.governor.steer(self, read)
        finally:
            # Every snapshot of this read, copied at once: nothing changes the hosts or
            # the LSTM state while the governor steers (restores wait for carry_out).
            self._copies.run()
            self._steering = False
            self._acted_from = None

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
        host = HostSnapshot.take(e.hosts[env], e.host_epoch, self._copies)
        e.record(LifecycleEvent(kind="snapshot", env=env, host_epoch=e.host_epoch))
        h, c = (self._copies.copy_of(state[:, env]) for state in self._acted_from)
        return EnvSnapshot(host, (h, c), self.store.pos[env], self._step, self._rollout)

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
        self.charged[env] = True

    def _check_env(self, env: int) -> None:
        if not 0 <= env < self.env.n_envs:
            raise IndexError(f"env {env} out of range for {self.env.n_envs} envs")

    # ----------------------------------------------------------- point 2: restores
    def carry_out(
        self, hidden: LSTMState, closed: list[int] | None
    ) -> tuple[np.ndarray, LSTMState]:
        """Restore the envs the governor asked for; which envs act now, and the LSTM state.

        ``closed``: per env, the position of the transition this read closed (just
        priced: the one whose epoch was judged; -1 or None: none). Each restored env keeps
        it, moved down to the first position it drops; restored envs do not act this
        step, and each resumes from the policy state its snapshot kept. Their refusal
        flags come back with the host: they live on each seed's lifecycle.
        """
        env, store = self.env, self.store
        active = np.ones(env.n_envs, dtype=bool)
        for e, snap in sorted(self._restores.items()):
            snap.host.restore(env.hosts[e])
            start = max(snap.position, int(self._settled[e]))
            keep = None if closed is None or closed[e] < 0 else closed[e]
            self.discarded[e] += store.invalidate(e, start, keep)
            if keep is not None:
                self._settled[e] = store.pos[e]
            self.rollbacks[e] += 1
            active[e] = False
            hidden = (
                _set_env(hidden[0], e, snap.hidden[0]),
                _set_env(hidden[1], e, snap.hidden[1]),
            )
            if self._detector is not None:
                self._detector.forget(e)
        self._restores.clear()
        return active, hidden


def _set_env(state: Tensor, env: int, value: Tensor) -> Tensor:
    """``state [layers, E, H]`` with env ``env``'s rows replaced by ``value [layers, H]``."""
    state = state.clone()
    state[:, env] = value
    return state
