"""A fit keeps the C heap's freed memory while it trains, and only while it runs."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch import Callback

from esper.callbacks.freed_memory import KeepFreedMemory
from esper.simic.module import PPOModule
from tests.mdp.envs import small_data
from tests.test_heap import EPOCH_PAGES, faults_of_epochs, glibc_defaults, glibc_only
from tests.trainers import quiet_trainer

__all__ = ["glibc_defaults"]  # the fixture, used by name below


class _Watch(Callback):
    """Counts the page faults of an epoch's worth of blocks while the fit trains (once
    kept, none whatever the heap held before); fails on demand."""

    def __init__(self, fail: bool = False) -> None:
        self.faults: list[int] = []
        self.keeping: list[bool] = []
        self.fail = fail

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.faults.append(faults_of_epochs())
        self.keeping += [c.keeping for c in trainer.callbacks if isinstance(c, KeepFreedMemory)]
        if self.fail:
            raise RuntimeError("a failing fit")


def _fit(trainer: L.Trainer) -> None:
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2, episode_epochs=2, host_kwargs={"channels": [4, 8]}, policy={"hidden_size": 16}
    )
    trainer.fit(module, datamodule=small_data())


def _kept(trainer: L.Trainer) -> list[bool]:
    return [c.keeping for c in trainer.callbacks if isinstance(c, KeepFreedMemory)]


@glibc_only
def test_a_fit_keeps_freed_memory_while_it_trains_and_stops_at_its_end(
    tmp_path: Path, glibc_defaults: None
) -> None:
    watch = _Watch()
    trainer = quiet_trainer(tmp_path, callbacks=[watch])
    _fit(trainer)
    assert watch.keeping == [True]
    assert watch.faults[0] < EPOCH_PAGES // 100
    assert _kept(trainer) == [False]


@glibc_only
def test_a_failing_fit_stops_keeping(tmp_path: Path, glibc_defaults: None) -> None:
    watch = _Watch(fail=True)
    trainer = quiet_trainer(tmp_path, callbacks=[watch])
    with pytest.raises(RuntimeError, match="a failing fit"):
        _fit(trainer)
    assert watch.keeping == [True]
    assert _kept(trainer) == [False]


@glibc_only
def test_a_process_that_tunes_malloc_itself_keeps_its_settings(
    tmp_path: Path, glibc_defaults: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=0")
    watch = _Watch()
    _fit(quiet_trainer(tmp_path, callbacks=[watch]))
    assert watch.keeping == [False]  # tests/test_heap.py: such a process faults every epoch


def test_keep_freed_memory_refuses_a_retention_of_another_type() -> None:
    with pytest.raises(TypeError, match=r"takes an esper\.heap\.HeapRetention, got dict"):
        KeepFreedMemory({"trim_threshold": 0})  # type: ignore[arg-type]
