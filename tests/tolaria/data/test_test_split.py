"""The held-out test split: every data module builds it, and a fit never reads it.

Validation pays the reward, feeds the observations, opens the gates and picks the best
checkpoint, so only a split that training never touches can report results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from esper.cli import main
from esper.tolaria.data import DataSplits, HostDataModule, SyntheticImageDataModule
from tests.test_cli import TINY_CONFIG

#: Every read of a tripwire is noted here (reset per test), in case a caller swallows
#: the error the read raises.
READS: list[str] = []
#: Each tripwire data module notes here that it built its splits.
BUILT: list[str] = []


class _TripwireSet(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A test split that fails any read: its length or any of its items."""

    def __len__(self) -> int:
        READS.append("len")
        raise AssertionError("the test split's length was read")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        READS.append(f"item {index}")
        raise AssertionError(f"test sample {index} was read")


class TripwireData(SyntheticImageDataModule):
    """Synthetic images whose test split is a tripwire (its own ``__init__`` is the parent's,
    so the CLI builds it from the usual synthetic arguments)."""

    def _build_datasets(self) -> DataSplits:
        BUILT.append(type(self).__name__)
        return super()._build_datasets()._replace(test=_TripwireSet())  # type: ignore[arg-type]


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fresh READS and BUILT, and the base class's test accessors rigged to trip too."""
    monkeypatch.setattr(f"{__name__}.READS", reads := [])
    monkeypatch.setattr(f"{__name__}.BUILT", [])

    def tripped(name: str) -> None:
        reads.append(name)
        raise AssertionError(f"HostDataModule.{name} was called during a fit")

    monkeypatch.setattr(
        HostDataModule, "host_test_dataloader", lambda self: tripped("host_test_dataloader")
    )
    monkeypatch.setattr(
        HostDataModule, "test_dataset", property(lambda self: tripped("test_dataset"))
    )
    return reads


def test_the_tripwire_trips_on_any_read(tripwires: list[str]) -> None:
    """Guards the fit test below: its tripwires do catch a read."""
    dm = TripwireData(n_train=32, n_val=8, batch_size=8)
    dm.setup()
    assert dm._test_set is not None
    for read in (len, lambda split: split[0]):
        with pytest.raises(AssertionError):
            read(dm._test_set)
    for accessor in (lambda: dm.test_dataset, dm.host_test_dataloader, lambda: dm.test_size):
        with pytest.raises(AssertionError):
            accessor()
    assert tripwires == ["len", "item 0", "test_dataset", "host_test_dataloader", "test_dataset"]


def test_a_fit_never_reads_the_test_split(
    tripwires: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real ``esper fit`` (one PPO update, the default callbacks) on tripwire data."""
    config = tmp_path / "tiny.yaml"
    config.write_text(
        TINY_CONFIG.replace("max_epochs: 2", "max_epochs: 1").replace(
            "esper.tolaria.data.SyntheticImageDataModule", f"{__name__}.TripwireData"
        )
    )
    root = tmp_path / "run"
    monkeypatch.setattr("sys.argv", ["esper"])
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(root)]) == 0
    assert BUILT == ["TripwireData"]  # the run did train on the tripwire data
    assert (root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert tripwires == []


# ------------------------------------------------------------- what _build_datasets returns
class _Returns(SyntheticImageDataModule):
    """Returns whatever the test puts in ``built``."""

    built: object = None

    def _build_datasets(self) -> DataSplits:
        return self.built  # type: ignore[return-value]


def _splits() -> DataSplits:
    return SyntheticImageDataModule(n_train=16, n_val=8, n_test=8, batch_size=8)._build_datasets()


def test_a_plain_tuple_of_three_datasets_is_taken_as_data_splits() -> None:
    dm = _Returns(batch_size=8)
    train, val, test = dm.built = tuple(_splits())
    assert dm.train_dataset is train and dm.val_dataset is val and dm.test_dataset is test
    assert dm.test_size == len(test) == 8


@pytest.mark.parametrize(
    ("built", "got"),
    [
        (lambda: tuple(_splits())[:2], "a tuple of 2 (TensorDataset, TensorDataset)"),
        (lambda: (*_splits(), _splits().test), "a tuple of 4"),
        (lambda: [*_splits()], "list"),
        (
            lambda: (*_splits()[:2], torch.zeros(8)),
            "a tuple of 3 (TensorDataset, TensorDataset, Tensor)",
        ),
        (lambda: None, "NoneType"),
    ],
)
def test_anything_but_three_datasets_is_a_type_error_naming_the_class(
    built: object, got: str
) -> None:
    dm = _Returns(batch_size=8)
    dm.built = built()  # type: ignore[operator]
    with pytest.raises(TypeError) as info:
        dm.setup()
    message = str(info.value)
    assert message.startswith(f"_Returns._build_datasets returned {got}")
    assert "must return DataSplits(train, val, test)" in message


def test_host_test_dataloader_is_built_like_the_validation_loader() -> None:
    """No shuffle, no dropped tail, val_batch_size: every test sample once, in order."""
    x = torch.arange(23, dtype=torch.float32).view(23, 1)
    dm = _Returns(batch_size=8, val_batch_size=10)
    dm.built = DataSplits(*_splits()[:2], TensorDataset(x, torch.arange(23)))
    batches = list(dm.host_test_dataloader())
    assert [len(y) for _, y in batches] == [10, 10, 3]
    assert torch.equal(torch.cat([y for _, y in batches]), torch.arange(23))
    val = dm.host_val_dataloader()
    test = dm.host_test_dataloader()
    assert (test.batch_size, test.drop_last) == (val.batch_size, val.drop_last)
    assert type(test.sampler) is type(val.sampler)


def test_no_lightning_test_hook_reads_the_test_split() -> None:
    """``trainer.test`` is not how Esper evaluates: the hook stays Lightning's stub."""
    assert "test_dataloader" not in vars(HostDataModule)
