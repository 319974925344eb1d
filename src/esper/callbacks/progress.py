"""What ``esper fit`` shows while it runs: a bar on a terminal, plain lines elsewhere.

An update is one rollout of ``episode_epochs`` host epochs and a PPO update; it can take
minutes. Lightning's bar counts training batches, of which an update has one, so it sat
at 0/1 for the whole update, and showed the previous update's metrics cut at the
terminal's width. :class:`UpdateProgressBar` moves with the host epochs instead:
update k/N and the run's elapsed time on the left, host epoch e/L as the bar, and the
last finished update's key figures after it.

Redirected to a file, a bar becomes carriage-return noise. :class:`ProgressLines` prints
what each update just measured, once, as CleanRL does: update k/N, the wall time so far,
env steps/s, mean return, host accuracy and seeds fossilized. ``esper fit`` uses it
instead of the bar when stdout is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from esper.callbacks.base import EsperCallback
from esper.contracts.rollout import RolloutSummary, StepBatch


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class ProgressLines(Callback):
    """Print one line per PPO update to ``stream`` (default: stdout), on rank 0 only."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream
        self._started = time.perf_counter()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics: dict[str, Any] = getattr(pl_module, "last_metrics", {})
        if not metrics:
            return
        print(self.line(trainer, metrics), file=self.stream or sys.stdout, flush=True)

    def line(self, trainer: Trainer, metrics: dict[str, Any]) -> str:
        return (
            f"update {trainer.current_epoch + 1}/{_total_updates(trainer)}  "
            f"{_elapsed(time.perf_counter() - self._started)}  "
            f"steps/s {metrics['perf/env_steps_per_s']:.2f}  "
            f"{_figures(metrics)}"
        )


def _total_updates(trainer: Trainer) -> int | str:
    return trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"


def _figures(metrics: dict[str, Any]) -> str:
    """An update's key figures, short enough for one line beside a bar."""
    return (
        f"return {metrics['train/episode_return']:+.4f}  "
        f"val acc {metrics['train/host_val_acc']:.4f}  "
        f"fossilized {metrics['train/seeds_fossilized']:.2f}  "
        f"approx_kl {metrics['ppo/approx_kl']:.4f}"
    )


class UpdateProgressBar(TQDMProgressBar, EsperCallback):
    """A bar over the host epochs of the running update, reset at every update.

    Its description says which update of how many and the time since the run started;
    its postfix holds the last finished update's return, host accuracy, seeds fossilized
    and approx_kl (not Lightning's list of every logged value). The hooks only count and
    redraw: everything they read is host-side.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position)
        self._started = time.perf_counter()
        self._figures = ""

    @property
    def train_description(self) -> str:
        return f"update {self.trainer.current_epoch + 1}/{_total_updates(self.trainer)}"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()
        super().on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        bar = self.train_progress_bar
        bar.reset(total=_episode_epochs(trainer))
        self._describe(trainer)

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        # The step closed the epoch after its decision: host_epoch + 1 epochs are done.
        self._show(trainer, step.host_epoch + 1)

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        self.train_progress_bar.set_postfix_str("PPO update", refresh=False)
        self._show(trainer, self.train_progress_bar.total)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *_: Any) -> None:
        metrics: dict[str, Any] = getattr(pl_module, "last_metrics", {})
        if metrics:
            self._figures = _figures(metrics)
        self.train_progress_bar.set_postfix_str(self._figures, refresh=False)
        self._show(trainer, self.train_progress_bar.total)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Nothing to add: the batch-end hook already showed the update's figures."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return {}

    def _show(self, trainer: Trainer, host_epochs: int) -> None:
        bar = self.train_progress_bar
        if bar.disable:
            return
        bar.n = host_epochs
        self._describe(trainer)
        bar.refresh()

    def _describe(self, trainer: Trainer) -> None:
        elapsed = _elapsed(time.perf_counter() - self._started)
        self.train_progress_bar.set_description(
            f"update {trainer.current_epoch + 1}/{_total_updates(trainer)} ({elapsed}) host epoch",
            refresh=False,
        )


def _episode_epochs(trainer: Trainer) -> int | None:
    env_config = getattr(trainer.lightning_module, "env_config", None)
    return getattr(env_config, "episode_epochs", None)
