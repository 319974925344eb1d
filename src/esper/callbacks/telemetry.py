"""Telemetry: the event log and the rollout metrics, under one name and one profile.

:class:`TelemetryCallback` is what ``esper fit`` enables by the registry name
``telemetry``. It holds the two halves and passes every hook to each:

* :class:`~esper.callbacks.events.EventLogCallback` (``.events``): ``events.jsonl`` in the
  run directory, one JSON object per lifecycle event, PPO update and episode end; its
  module docstring has the schema.
* :class:`~esper.callbacks.metrics.MetricsCallback` (``.metrics``): per-rollout scalars
  through every configured Lightning logger (TensorBoard, CSV, MLflow, W&B, ...), action
  histograms through a TensorBoard logger; ``docs/metrics.md`` lists the names.

One ``profile`` (``minimal``, ``normal``, ``debug``; the table is in
:mod:`esper.callbacks.profiles`) sets both. Either half can also be used alone, in place
of this callback (not beside it: both would write the same file or names, and setup
refuses that).

Checkpoint state is both halves' under one key, ``{"version": 2, "events": ...,
"metrics": ...}``; the version 1 state of the callback before the split (the event log's
alone) still loads, the metrics' blueprint totals taken from the event log's counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from esper.callbacks.base import EsperCallback, check_state_version
from esper.callbacks.events import EventLogCallback, check_events_file
from esper.callbacks.metrics import MetricsCallback, check_histogram_every
from esper.callbacks.profiles import PROFILE_NORMAL, check_profile
from esper.contracts.rollout import RolloutSummary, StepBatch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

_STATE_VERSION = 2
#: The state version before the split: the event log's state, at the top level.
_EVENT_LOG_ONLY_VERSION = 1


class TelemetryCallback(EsperCallback):
    """Writes lifecycle events to a JSONL file and rollout summaries to the loggers.

    Args:
        profile: how much to collect: ``"minimal"``, ``"normal"`` or ``"debug"`` (see
            :mod:`esper.callbacks.profiles`). ``"debug"`` also measures the host reads of
            each rollout and logs ``perf/host_reads_per_step``
            (``.metrics.last_host_reads.report()`` says where they came from).
        events_file: name of the JSONL file, relative to the run directory (an absolute
            path is used as given). Opened in append mode, so a resumed run continues it.
        histogram_every: log the action histograms and op rates every this many rollouts;
            ``1`` logs them every rollout.
    """

    def __init__(
        self,
        profile: str = PROFILE_NORMAL,
        events_file: str = "events.jsonl",
        histogram_every: int = 1,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_profile(name, profile)
        self.profile = profile
        self.events_file = check_events_file(name, events_file)
        self.histogram_every = check_histogram_every(name, histogram_every)
        #: The event log half.
        self.events = EventLogCallback(profile=profile, events_file=self.events_file)
        #: The metrics half.
        self.metrics = MetricsCallback(profile=profile, histogram_every=histogram_every)

    @property
    def parts(self) -> tuple[EventLogCallback, MetricsCallback]:
        """The callbacks this one runs, in the order their hooks are called (metrics'
        ``on_rollout_end`` runs first, to end its host-read count before the log writes)."""
        return (self.events, self.metrics)

    # ----------------------------------------------------------------- Lightning
    @property
    def state_key(self) -> str:
        return self._generate_state_key(events_file=self.events_file)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for part in self.parts:
            part.setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for part in self.parts:
            part.on_fit_start(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for part in self.parts:
            part.on_fit_end(trainer, pl_module)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        for part in self.parts:
            part.on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for part in self.parts:
            part.teardown(trainer, pl_module, stage)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "events": self.events.state_dict(),
            "metrics": self.metrics.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version = state_dict.get("version")
        if version == _EVENT_LOG_ONLY_VERSION:
            self.events.load_state_dict(state_dict)
            self.metrics.load_state_dict(
                {
                    "version": 1,
                    "blueprint_totals": state_dict["blueprint_counts"],
                    "steps_per_rollout": state_dict["steps_per_rollout"],
                }
            )
            return
        check_state_version("TelemetryCallback", state_dict, _STATE_VERSION)
        self.events.load_state_dict(state_dict["events"])
        self.metrics.load_state_dict(state_dict["metrics"])

    # ------------------------------------------------------------ rollout hooks
    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        for part in self.parts:
            part.on_rollout_start(trainer, pl_module, rollout)

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        self.events.on_env_step(trainer, pl_module, step)
        self.metrics.on_env_step(trainer, pl_module, step)

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        for part in reversed(self.parts):
            part.on_rollout_end(trainer, pl_module, rollout)

    def on_ppo_update_end(
        self, trainer: Trainer, pl_module: LightningModule, metrics: dict[str, float]
    ) -> None:
        for part in self.parts:
            part.on_ppo_update_end(trainer, pl_module, metrics)


__all__ = ["TelemetryCallback"]
