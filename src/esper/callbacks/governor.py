"""The governor: per-env snapshots, and a rollback of one env when its training panics.

A panic (a non-finite training loss, or one more than ``sigma`` standard deviations above
the env's recent history) is decided on the device by a :class:`PanicDetector` whose
``[E]`` code rides in the step's packed transfer. The governor only reads that host copy:
it asks the rollout collector to restore the panicking env from its latest snapshot, which
drops that env's transitions since the snapshot and charges it the rollback penalty
(``RewardConfig.rollback_penalty``). Every other env keeps all its transitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from esper.callbacks.base import EsperCallback
from esper.contracts.rollout import RolloutSummary, StepBatch
from esper.simic.panic import PANIC_NONFINITE, PanicConfig, PanicDetector

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from esper.simic.rollout import RolloutCollector

#: The name of the governor's signal in ``StepBatch.probes``.
PROBE = "panic"


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
        self._collector: RolloutCollector | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        collector = getattr(pl_module, "collector", None)
        if collector is None:
            raise TypeError(
                "GovernorCallback needs a module with a rollout collector "
                f"(esper.simic.module.PPOModule), got {type(pl_module).__name__}"
            )
        if PROBE not in collector.probes:
            detector = PanicDetector(self.panic, collector.env.n_envs, collector.env.device)
            collector.add_probe(PROBE, detector)
        self._collector = collector

    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        collector = self._require_collector()
        for env in range(collector.env.n_envs):
            collector.request_snapshot(env)  # taken at the first decision

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        collector = self._require_collector()
        if bool(step.done.all()):
            return  # the episode is over: nothing left to save
        codes = step.probes.get(PROBE)
        panicking = np.zeros(step.n_envs, dtype=bool) if codes is None else codes > 0
        for env in np.flatnonzero(panicking):
            what = (
                "non-finite training loss"
                if codes[env] >= PANIC_NONFINITE
                else (f"training loss above {self.panic.sigma:g} sigma of its recent history")
            )
            if not collector.request_rollback(int(env), f"panic: {what}"):
                self.unrecoverable += 1
        routine = (step.host_epoch + 1) % self.snapshot_every == 0
        fossilized = {e.env for e in step.events if e.kind == "fossilized"}
        for env in range(step.n_envs):
            if not panicking[env] and (routine or env in fossilized):
                collector.request_snapshot(env)

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        self.total_rollbacks += int(rollout.rollbacks.sum())
        self.total_discarded += int(rollout.discarded_transitions.sum())

    def _require_collector(self) -> RolloutCollector:
        if self._collector is None:
            raise RuntimeError("GovernorCallback was not set up: on_train_start has not run")
        return self._collector

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
