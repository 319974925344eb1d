"""The governor: per-env snapshots, and a rollback of one env when its training panics.

Its whole policy is here: it snapshots every env at the start of each episode, every
``snapshot_every`` host epochs and right after a fossilize, and keeps the latest snapshot
of each env. A panic (a non-finite training loss, or one more than ``sigma`` standard
deviations above the env's recent history) is decided on the device by the rollout's
panic test, configured with this governor's :class:`~esper.mdp.governor.PanicConfig`;
its ``[E]`` code rides in the step's packed transfer. On a panic the governor asks the
rollout to restore that env alone from its latest snapshot and charges the rollback
penalty (``RewardConfig.rollback_penalty``) to the transition whose epoch panicked. The
restore drops that env's transitions since the snapshot but that one, which stays in the
batch as the last before the restore, so PPO learns the penalty (and GAE bootstraps it
from the restored state's value). Every other env keeps all its transitions.

The rollout calls :meth:`GovernorCallback.steer` at each read, through the control surface
of :mod:`esper.mdp.governor`; :class:`~esper.simic.module.PPOModule` registers the
governor among the trainer's callbacks with its rollout collector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from esper.callbacks.base import EsperCallback
from esper.contracts.rollout import RolloutSummary
from esper.mdp.governor import (
    PANIC_NONE,
    PANIC_NONFINITE,
    EnvSnapshot,
    GovernorRead,
    PanicConfig,
    RolloutControl,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


class GovernorCallback(EsperCallback):
    """Snapshots every ``snapshot_every`` epochs and after each fossilize; rolls back on panic.

    Args:
        snapshot_every: host epochs between routine snapshots of every env (>= 1).
        sigma, window, min_history: the loss-spike test, see :class:`PanicConfig`.
    """

    def __init__(
        self,
        snapshot_every: int = 5,
        sigma: float = PanicConfig.sigma,
        window: int = PanicConfig.window,
        min_history: int = PanicConfig.min_history,
    ) -> None:
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int):
            raise ValueError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        if snapshot_every < 1:
            raise ValueError(
                f"snapshot_every must be >= 1 (epochs between snapshots), got {snapshot_every}"
            )
        self.snapshot_every = snapshot_every
        self.panic = PanicConfig(sigma=sigma, window=window, min_history=min_history)
        self.total_rollbacks = 0
        self.total_discarded = 0
        self.unrecoverable = 0
        #: The latest snapshot of each env in the running rollout.
        self.snapshots: dict[int, EnvSnapshot] = {}

    def steer(self, control: RolloutControl, read: GovernorRead) -> None:
        """Restore and charge each panicking env, then snapshot the envs that are due."""
        if read.step == 0:
            # A fresh episode: nothing older to go back to, so its first epoch only
            # gives every env its first snapshot.
            self.snapshots = {env: control.snapshot(env) for env in range(read.n_envs)}
            return
        panicking = read.panic > PANIC_NONE
        for env in map(int, np.flatnonzero(panicking)):
            snapshot = self.snapshots.get(env)
            if snapshot is None:
                self.unrecoverable += 1
                continue
            control.request_restore(env, snapshot, f"panic: {self._describe(read.panic[env])}")
            control.penalise(env)
        routine = read.host_epoch % self.snapshot_every == 0
        for env in range(read.n_envs):
            if not panicking[env] and (routine or read.fossilized[env]):
                self.snapshots[env] = control.snapshot(env)

    def _describe(self, code: float) -> str:
        if code >= PANIC_NONFINITE:
            return "non-finite training loss"
        return f"training loss above {self.panic.sigma:g} sigma of its recent history"

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        self.total_rollbacks += int(rollout.rollbacks.sum())
        self.total_discarded += int(rollout.discarded_transitions.sum())
        self.snapshots = {}  # host copies of an episode that is over: free their memory

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_rollbacks": self.total_rollbacks,
            "total_discarded": self.total_discarded,
            "unrecoverable": self.unrecoverable,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total_rollbacks = int(state_dict["total_rollbacks"])
        self.total_discarded = int(state_dict["total_discarded"])
        self.unrecoverable = int(state_dict["unrecoverable"])
