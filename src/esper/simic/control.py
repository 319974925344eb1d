"""The governor's control surface on the rollout: the panic signal it reads, what it may ask.

The rollout loop (:class:`~esper.simic.rollout.RolloutCollector`) owns the mechanics; a
:class:`Governor` (``esper.callbacks.GovernorCallback``) owns the policy (when to snapshot,
when to restore, whom to charge) and keeps its snapshots. Between them sits this surface:

* the **panic signal**: an env panics when its training loss is not finite, or rises more
  than ``sigma`` standard deviations above that env's recent history. A
  :class:`PanicDetector` tests all envs at once on the device with the governor's
  :class:`PanicConfig`; its ``[E]`` code rides in the step's packed transfer, so the
  governor reads it host-side (:class:`GovernorRead`, ``StepBatch.probes["panic"]``)
  without an extra read;
* :class:`RolloutControl`: ``snapshot(env)``, ``request_restore(env, snapshot, reason)``
  and ``penalise(env)``, each about one env only.

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
        to restore both later."""
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
