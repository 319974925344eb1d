"""A small real fit that records each update's mean episode return, for the resume tests:
stopped after some updates (``stop_after``) and resumed, it must repeat an unbroken run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from esper.callbacks.base import EsperCallback
from esper.callbacks.checkpoint import default_checkpoints
from esper.simic.module import PPOModule
from esper.simic.ppo import PPOConfig
from tests.mdp.envs import small_data
from tests.trainers import quiet_trainer

EPISODE_EPOCHS = 3

#: Optimiser steps in one PPO update with the default PPOConfig: an update's worth of
#: ``max_steps`` stops a run after that many updates without changing ``max_epochs``, on
#: which the learning-rate annealing depends (an interrupted run, not a shorter one).
STEPS_PER_UPDATE = PPOConfig().update_epochs * PPOConfig().n_minibatches


class ReturnRecorder(EsperCallback):
    def __init__(self) -> None:
        self.returns: list[float] = []

    def on_ppo_update_end(self, trainer, pl_module, metrics) -> None:  # type: ignore[no-untyped-def]
        self.returns.append(metrics["train/episode_return"])


def recorded_fit(
    root: Path,
    max_epochs: int,
    ckpt_path: str | None = None,
    stop_after: int | None = None,
    accelerator: str = "cpu",
    **module_kwargs: Any,
) -> tuple[PPOModule, list[float]]:
    """A 2-env fit of ``max_epochs`` updates under ``root`` with checkpoints (seed 0);
    the module and each update's return. ``module_kwargs`` go to ``PPOModule``."""
    L.seed_everything(0, verbose=False)
    recorder = ReturnRecorder()
    module = PPOModule(
        n_envs=2, episode_epochs=EPISODE_EPOCHS, host_kwargs={"channels": [4, 8]}, **module_kwargs
    )
    trainer = quiet_trainer(
        root,
        max_epochs,
        max_steps=-1 if stop_after is None else stop_after * STEPS_PER_UPDATE,
        callbacks=[*default_checkpoints(), recorder],
        enable_checkpointing=True,
        accelerator=accelerator,
    )
    trainer.fit(module, datamodule=small_data(), ckpt_path=ckpt_path)
    return module, recorder.returns
