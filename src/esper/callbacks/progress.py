"""One plain line per PPO update, for logs and pipes where a progress bar is noise.

Redirected to a file, Lightning's bar becomes carriage-return spam and shows the previous
update's numbers. This prints what the update just measured, once, as CleanRL does:
update k/N, the wall time so far, env steps/s, mean return, host accuracy and seeds
fossilized. ``esper fit`` uses it instead of the bar when stdout is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from lightning.pytorch import Callback, LightningModule, Trainer


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
        total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        return (
            f"update {trainer.current_epoch + 1}/{total}  "
            f"{_elapsed(time.perf_counter() - self._started)}  "
            f"steps/s {metrics['perf/env_steps_per_s']:.2f}  "
            f"return {metrics['train/episode_return']:+.4f}  "
            f"val acc {metrics['train/host_val_acc']:.4f}  "
            f"fossilized {metrics['train/seeds_fossilized']:.2f}  "
            f"approx_kl {metrics['ppo/approx_kl']:.4f}"
        )
