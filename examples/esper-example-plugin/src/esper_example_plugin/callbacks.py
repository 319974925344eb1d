"""A callback that counts seeds germinated and fossilized in each rollout.

It reads only what the rollout hooks hand it (host-side events and numpy arrays), so it
adds no device-to-host reads. Per rollout it logs, through the trainer's loggers::

    seed_counter/germinated, seed_counter/fossilized              (this rollout, all envs)
    seed_counter/germinated_total, seed_counter/fossilized_total  (since the run began)

``pl_module.log`` is not used: Lightning checks ``self.log`` against the Lightning hook that
is running, and the rollout hooks are Esper's (called from inside ``training_step``), so
the metrics go straight to ``trainer.loggers`` with ``step`` = the rollout index (= the
PPO update index; ``rollout.rollout``), which works wherever a hook is called from. With
``Trainer(logger=False)`` nothing is written; ``last_metrics`` still holds the values.

The running totals are saved in checkpoints through ``state_dict`` / ``load_state_dict``,
so a resumed run keeps counting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from esper.callbacks.base import EsperCallback

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from esper.contracts.rollout import RolloutSummary, StepBatch

#: The ``LifecycleEvent.kind`` values counted (a FOSSILIZED seed is also reported as
#: "advanced"; only the "fossilized" event is counted, so nothing is counted twice).
COUNTED_KINDS: tuple[str, ...] = ("germinated", "fossilized")


class SeedCounter(EsperCallback):
    """Counts ``germinated`` / ``fossilized`` lifecycle events per rollout and logs them.

    Args:
        prefix: metric name prefix; also tells two counters apart in a checkpoint.
    """

    def __init__(self, prefix: str = "seed_counter") -> None:
        super().__init__()
        self.prefix = prefix
        #: Counts of the rollout in progress.
        self.current: dict[str, int] = dict.fromkeys(COUNTED_KINDS, 0)
        #: Counts of every finished rollout since the run began.
        self.totals: dict[str, int] = dict.fromkeys(COUNTED_KINDS, 0)
        self.rollouts = 0
        #: What the last finished rollout logged.
        self.last_metrics: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    # ------------------------------------------------------------- rollout hooks
    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        self.current = dict.fromkeys(COUNTED_KINDS, 0)

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        for event in getattr(step, "events", ()):
            if event.kind in self.current:
                self.current[event.kind] += 1

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        for kind, n in self.current.items():
            self.totals[kind] += n
        self.rollouts += 1
        metrics = {f"{self.prefix}/{kind}": float(n) for kind, n in self.current.items()}
        metrics.update({f"{self.prefix}/{kind}_total": float(n) for kind, n in self.totals.items()})
        self.last_metrics = metrics
        # A Lightning Trainer always has `loggers` (empty with logger=False).
        for logger in getattr(trainer, "loggers", None) or ():
            logger.log_metrics(metrics, step=rollout.rollout)
        # Reset here too, so the counts stay per rollout even if on_rollout_start is not called.
        self.current = dict.fromkeys(COUNTED_KINDS, 0)

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "current": dict(self.current),
            "totals": dict(self.totals),
            "rollouts": self.rollouts,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.current = {k: int(state_dict["current"].get(k, 0)) for k in COUNTED_KINDS}
        self.totals = {k: int(state_dict["totals"].get(k, 0)) for k in COUNTED_KINDS}
        self.rollouts = int(state_dict["rollouts"])
