"""A fit keeps the objects alive at its start out of full collections, and only while it runs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch import Callback

from esper.callbacks.gc_freeze import FreezeStartupObjects
from esper.simic.module import PPOModule
from tests.mdp.envs import small_data
from tests.trainers import quiet_trainer


class _Watch(Callback):
    """Records the freeze count while the fit trains; fails on demand."""

    def __init__(self, fail: bool = False) -> None:
        self.counts: list[int] = []
        self.fail = fail

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.counts.append(gc.get_freeze_count())
        if self.fail:
            raise RuntimeError("a failing fit")


@pytest.fixture(autouse=True)
def _nothing_frozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _fit(tmp_path: Path, watch: _Watch) -> None:
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2, episode_epochs=2, host_kwargs={"channels": [4, 8]}, policy={"hidden_size": 16}
    )
    trainer = quiet_trainer(tmp_path, callbacks=[watch])
    trainer.fit(module, datamodule=small_data())


def test_a_fit_freezes_what_is_alive_at_its_start_and_unfreezes_at_its_end(
    tmp_path: Path,
) -> None:
    watch = _Watch()
    _fit(tmp_path, watch)
    assert len(watch.counts) == 1 and watch.counts[0] > 0
    assert gc.get_freeze_count() == 0


def test_a_failing_fit_unfreezes(tmp_path: Path) -> None:
    watch = _Watch(fail=True)
    with pytest.raises(RuntimeError, match="a failing fit"):
        _fit(tmp_path, watch)
    assert watch.counts[0] > 0
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_its_arrangement(tmp_path: Path) -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    watch = _Watch()
    _fit(tmp_path, watch)
    # Frozen objects freed by reference counting leave the count; none joined it (a
    # second freeze would add everything the fit's setup built), none was unfrozen.
    assert len(watch.counts) == 1 and 0 < watch.counts[0] <= before
    assert 0 < gc.get_freeze_count() <= before


def test_with_the_collector_disabled_nothing_is_frozen() -> None:
    callback = FreezeStartupObjects()
    gc.disable()
    try:
        callback.on_fit_start(None, None)  # type: ignore[arg-type]
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
