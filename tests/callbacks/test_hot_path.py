"""With every built-in callback on, the rollout still reads the device once per host epoch."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from esper.callbacks import GovernorCallback, TelemetryCallback
from esper.callbacks.checkpoint import default_checkpoints
from esper.callbacks.progress import UpdateProgressBar
from esper.simic.module import PPOModule
from tests.callbacks.counting import count_rollout_reads
from tests.mdp.envs import small_data

EPISODE_EPOCHS = 4


@pytest.mark.parametrize("n_envs", [2, 8])
def test_rollouts_read_once_per_host_epoch_with_all_builtin_callbacks(
    tmp_path: Path, n_envs: int
) -> None:
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=n_envs, episode_epochs=EPISODE_EPOCHS, host_kwargs={"channels": [4, 8]}
    )
    counted = count_rollout_reads(module)
    governor = GovernorCallback()
    trainer = L.Trainer(
        max_epochs=2,
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(tmp_path),
        callbacks=[
            TelemetryCallback(profile="normal"),
            governor,
            UpdateProgressBar(),
            *default_checkpoints(),
        ],
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=small_data())
    assert module.collector is not None and module.collector.governor is governor
    assert counted.reads == [EPISODE_EPOCHS, EPISODE_EPOCHS], "one packed read per host epoch"
    reported = [s.packed_transfers for s in counted.summaries]
    assert reported == counted.reads, "reported transfers != measured"
