"""Host loaders cut a TensorDataset's batches whole: the batches, their order and the
shuffle generator's draws are those of a sample-by-sample DataLoader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from esper.contracts.config_errors import ConfigError
from esper.tolaria.data import SyntheticImageDataModule
from esper.tolaria.data.base import DataSplits, _BatchRows

SHAPE = (3, 8, 8)


def _module(**kwargs: object) -> SyntheticImageDataModule:
    data = SyntheticImageDataModule(
        input_shape=SHAPE, n_classes=5, n_train=100, n_val=30, n_test=30, **kwargs
    )
    data.setup("fit")
    return data


def _same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> None:
    assert len(a) == len(b)
    for batch_a, batch_b in zip(a, b, strict=True):
        for ta, tb in zip(batch_a, batch_b, strict=True):
            assert torch.equal(ta, tb) and ta.dtype == tb.dtype and ta.stride() == tb.stride()


def test_train_batches_are_a_sample_by_sample_loaders_epoch_after_epoch() -> None:
    data = _module(batch_size=16, seed=4)
    ours = data.host_train_dataloader()
    generator = torch.Generator().manual_seed(4)
    plain = DataLoader(
        data.train_dataset, batch_size=16, shuffle=True, drop_last=True, generator=generator
    )
    assert len(ours) == len(plain) == 100 // 16
    for _ in range(3):  # each epoch draws a new order from the loader's own generator
        _same(list(ours), list(plain))


def test_validation_and_test_batches_keep_every_sample_in_order() -> None:
    data = _module(batch_size=16, val_batch_size=8)
    _same(list(data.host_val_dataloader()), list(DataLoader(data.val_dataset, batch_size=8)))
    data.setup("test")
    _same(list(data.host_test_dataloader()), list(DataLoader(data.test_dataset, batch_size=8)))
    assert [len(y) for _, y in data.host_val_dataloader()] == [8, 8, 8, 6]  # the short tail


def test_a_tensor_dataset_is_fetched_a_batch_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _module(batch_size=16)
    calls: list[object] = []
    fetch = _BatchRows.__getitem__

    def counted(self: _BatchRows, index: list[int]) -> tuple[torch.Tensor, ...]:
        calls.append(index)
        return fetch(self, index)

    def refused(self: TensorDataset, index: object) -> tuple[torch.Tensor, ...]:
        raise AssertionError("fetched through TensorDataset's list indexing")

    monkeypatch.setattr(_BatchRows, "__getitem__", counted)
    monkeypatch.setattr(TensorDataset, "__getitem__", refused)
    batches = list(data.host_train_dataloader())
    assert len(calls) == len(batches) == 100 // 16
    assert all(isinstance(index, list) and len(index) == 16 for index in calls)


def test_batch_rows_gather_every_tensor_and_dtype_as_list_indexing_does() -> None:
    tokens = torch.arange(40, dtype=torch.int32).reshape(10, 4)
    dataset = TensorDataset(torch.randn(10, 2, 3), tokens, torch.arange(10))
    rows = _BatchRows(dataset)
    assert len(rows) == 10
    for indices in ([3, 1, 4, 1, 5], [9], list(range(10))):
        _same([rows[indices]], [dataset[indices]])


class _Rows(Dataset):
    """A plugin's own dataset: indexable one sample at a time only."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(i, int):
            raise TypeError(f"one sample at a time, got {type(i).__name__}")
        return self.x[i], self.y[i]


class _PluginData(SyntheticImageDataModule):
    def _build_datasets(self) -> DataSplits:
        built = super()._build_datasets()
        return DataSplits(*(_Rows(*split.tensors) for split in built))


def test_another_dataset_loads_sample_by_sample_as_before() -> None:
    data = _PluginData(input_shape=SHAPE, n_classes=5, n_train=100, n_val=30, batch_size=16)
    data.setup("fit")
    x, y = next(iter(data.host_train_dataloader()))
    assert x.shape == (16, *SHAPE) and y.shape == (16,)
    assert sum(len(y) for _, y in data.host_val_dataloader()) == 30


def _on(device: str) -> SimpleNamespace:
    """What the loaders read of a fit's trainer: the device its strategy trains on."""
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))


def test_rows_gathered_on_a_device_are_the_rows_gathered_on_the_host() -> None:
    data = _module(batch_size=16)
    indices = [7, 3, 99, 0, 42]
    host = _BatchRows(data.train_dataset)[indices]
    placed = _BatchRows(data.train_dataset, torch.device("cpu"))[indices]
    _same([host], [placed])


def test_splits_stay_on_the_host_outside_a_fit_on_a_cpu_or_when_too_large() -> None:
    data = _module(batch_size=16)
    split = data.train_dataset
    assert data._resident_device(split) is None  # no trainer: evaluation, scripts
    data.trainer = _on("cpu")
    assert data._resident_device(split) is None
    data.trainer = _on("cuda")
    assert data._resident_device(split) == torch.device("cuda")
    size = sum(t.numel() * t.element_size() for t in split.tensors)
    for kwargs, resident in (
        ({"resident_bytes": size}, True),
        ({"resident_bytes": size - 1}, False),
        ({"resident_bytes": 0}, False),
        ({"num_workers": 1}, False),
    ):
        other = _module(batch_size=16, **kwargs)
        other.trainer = _on("cuda")
        assert (other._resident_device(split) is not None) is resident, kwargs


def test_resident_bytes_must_be_a_count_of_bytes() -> None:
    with pytest.raises(ConfigError, match=r"resident_bytes: must be an int >= 0"):
        _module(resident_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_fit_on_a_gpu_gathers_the_host_batches_there() -> None:
    data = _module(batch_size=16, seed=4)
    host_train, host_val = data.host_train_dataloader(), data.host_val_dataloader()
    data.trainer = _on("cuda")
    train, val = data.host_train_dataloader(), data.host_val_dataloader()
    assert not train.pin_memory
    for ours, theirs in ((train, host_train), (val, host_val)):
        for _ in range(2):
            batches = list(ours)
            assert all(t.device.type == "cuda" for batch in batches for t in batch)
            _same([tuple(t.cpu() for t in b) for b in batches], list(theirs))
