"""TimelineCallback: a picture of one env's episode every few PPO updates.

Every ``every_n_updates`` rollouts (rollout index ``% every_n_updates == 0``, so the first
one is drawn) the callback keeps that rollout's :class:`~esper.contracts.rollout.StepBatch`
objects (host-side; a list append per step, nothing in the other rollouts) and at
``on_rollout_end`` draws env ``env``'s timeline with
:func:`esper.report.render_timeline`: seed stage per slot and host epoch, germinate /
fossilize / prune markers, rollbacks, the host's accuracy. It is

* logged to TensorBoard as the image ``timeline/env<env>`` at step = rollout index, when
  the trainer has a ``TensorBoardLogger`` (skipped otherwise), and
* saved as ``timeline_rollout<NNNN>.png`` in ``trainer.log_dir`` (``default_root_dir``
  without a logger).

Only global rank 0 draws (its own envs; ``env`` indexes them). Slot names come from the
module's env (``pl_module.env.slot_ids``). Every hook reads host-side arrays only; no
device tensor is touched, so the rollout stays sync-free. Drawing (a fraction of a second
of matplotlib per picture) happens in a helper process
(:class:`esper.report.drawer.BackgroundDrawer`): the rollout hands the steps over and goes
on; finished pictures are logged at the next rollout's start, and teardown waits for the
rest.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from esper.callbacks.base import EsperCallback, check_state_version
from esper.contracts.rollout import RolloutSummary, StepBatch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from esper.report.drawer import BackgroundDrawer, Drawn

_STATE_VERSION = 1


class TimelineCallback(EsperCallback):
    """Draws env ``env``'s seed timeline every ``every_n_updates`` rollouts, and the run's
    last rollout (``trainer.max_epochs - 1``), so even a short run pictures its first and
    its final policy.

    Args:
        every_n_updates: draw rollouts whose index is a multiple of this (``1``: all).
        env: which env of this rank to draw.
    """

    def __init__(self, every_n_updates: int = 10, env: int = 0) -> None:
        super().__init__()
        if isinstance(every_n_updates, bool) or not isinstance(every_n_updates, int):
            raise TypeError(
                f"TimelineCallback(every_n_updates={every_n_updates!r}) must be an int >= 1"
            )
        if every_n_updates < 1:
            raise ValueError(
                f"TimelineCallback(every_n_updates={every_n_updates}) must be >= 1 "
                "(1 draws every rollout)"
            )
        if isinstance(env, bool) or not isinstance(env, int):
            raise TypeError(f"TimelineCallback(env={env!r}) must be an int >= 0")
        if env < 0:
            raise ValueError(f"TimelineCallback(env={env}) must be >= 0 (an env index)")
        self.every_n_updates = every_n_updates
        self.env = env
        #: The pictures written so far in this process (each once the helper is done).
        self.written: list[Path] = []
        self._drawer: BackgroundDrawer | None = None
        self._enabled: bool | None = None
        self._out_dir: Path | None = None
        self._steps: list[StepBatch] = []
        self._last_rollout: int | None = None

    # ----------------------------------------------------------------- Lightning
    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_updates=self.every_n_updates, env=self.env)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # ``trainer.log_dir`` broadcasts from rank 0: every rank must ask for it.
        log_dir = trainer.log_dir
        self._out_dir = Path(log_dir if log_dir is not None else trainer.default_root_dir)
        self._enabled = bool(trainer.is_global_zero)
        max_epochs = trainer.max_epochs
        self._last_rollout = max_epochs - 1 if max_epochs is not None and max_epochs > 0 else None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._steps = []
        self._enabled = None
        self._finish_drawing(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # Lightning's Ctrl-C path does not reach teardown: the pictures asked for are
        # finished and the helper stopped here too.
        self._finish_drawing(trainer)

    def _finish_drawing(self, trainer: Trainer) -> None:
        """Write and log every picture asked for, then stop the helper process."""
        drawer, self._drawer = self._drawer, None
        if drawer is None:
            return
        try:
            self._collect(trainer, drawer, wait=True)
        finally:
            drawer.close()

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "every_n_updates": self.every_n_updates,
            "env": self.env,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Nothing to restore: the schedule follows the rollout index, and the config given
        # to this instance wins over the one the checkpoint recorded.
        check_state_version("TimelineCallback", state_dict, _STATE_VERSION)

    # ------------------------------------------------------------ rollout hooks
    def draws(self, rollout: int) -> bool:
        """Whether rollout ``rollout`` is drawn."""
        return rollout % self.every_n_updates == 0 or rollout == self._last_rollout

    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        if self._check_enabled() and self._drawer is not None:
            self._collect(trainer, self._drawer, wait=False)
        self._steps = []

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        if self._check_enabled() and self.draws(step.rollout):
            self._steps.append(step)

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        if not self._check_enabled():
            return
        steps = [s for s in self._steps if s.rollout == rollout.rollout]
        self._steps = []
        if not steps or not self.draws(rollout.rollout):
            return
        n_envs = steps[0].n_envs
        if self.env >= n_envs:
            raise ValueError(
                f"TimelineCallback(env={self.env}) but this rank's env holds {n_envs} envs "
                f"(0..{n_envs - 1})"
            )
        assert self._out_dir is not None, "setup() sets the output folder"
        path = self._out_dir / f"timeline_rollout{rollout.rollout:04d}.png"
        from esper.report.drawer import BackgroundDrawer, Job  # matplotlib: when drawing

        if self._drawer is None:
            self._drawer = BackgroundDrawer()
        self._drawer.submit(Job(rollout.rollout, steps, self.env, _slot_ids(pl_module), path))
        self._collect(trainer, self._drawer, wait=False)

    def _collect(self, trainer: Trainer, drawer: BackgroundDrawer, wait: bool) -> None:
        """Log what the helper finished (all it was asked for, with ``wait``). A picture
        that could not be drawn is a warning: the run and its other pictures go on."""
        from esper.report.drawer import DrawingError

        results = drawer.wait() if wait else drawer.finished()
        for failed in (r for r in results if isinstance(r, DrawingError)):
            warnings.warn(f"TimelineCallback: {failed}", stacklevel=2)
        self._log(trainer, [r for r in results if not isinstance(r, DrawingError)])

    def _log(self, trainer: Trainer, drawn: list[Drawn]) -> None:
        """Record finished pictures and log them to TensorBoard at their rollout."""
        writer = _summary_writer(trainer) if drawn else None
        for picture in drawn:
            self.written.append(picture.path)
            if writer is not None:
                writer.add_image(
                    f"timeline/env{self.env}",
                    picture.image,
                    global_step=picture.key,
                    dataformats="HWC",
                )

    def _check_enabled(self) -> bool:
        if self._enabled is None:
            raise RuntimeError(
                "TimelineCallback was not set up: pass it to Trainer(callbacks=[...]) so "
                "Lightning calls its setup() before the rollout hooks"
            )
        return self._enabled


def _slot_ids(pl_module: LightningModule) -> list[str]:
    slot_ids = getattr(getattr(pl_module, "env", None), "slot_ids", None)
    if slot_ids is None:
        raise AttributeError(
            f"TimelineCallback needs the slot names at pl_module.env.slot_ids; "
            f"{type(pl_module).__name__} has none (use it with esper's PPOModule)"
        )
    return [str(s) for s in slot_ids]


def _summary_writer(trainer: Trainer) -> Any:
    """The experiment (SummaryWriter) of the trainer's first TensorBoardLogger, or None."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


__all__ = ["TimelineCallback"]
