"""The embedded digits data: real samples, balanced splits, reproducible loaders."""

from __future__ import annotations

import math

import pytest
import torch

from esper.tolaria.data import DigitsDataModule
from esper.tolaria.data.digits import DIGITS_N_CLASSES, DIGITS_SHAPE

N_DIGITS = 1797
BATCH = 64


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    return DigitsDataModule(batch_size=BATCH, val_batch_size=256, seed=3)


def test_loads_all_samples_with_shapes(digits: DigitsDataModule) -> None:
    assert digits.train_size + digits.val_size == N_DIGITS
    x, y = digits.train_dataset.tensors
    assert x.shape[1:] == DIGITS_SHAPE == digits.input_shape
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert digits.n_classes == DIGITS_N_CLASSES and digits.task == "classification"
    expected_val = N_DIGITS * digits.val_fraction
    assert abs(digits.val_size - expected_val) <= DIGITS_N_CLASSES


def test_both_splits_hold_every_class(digits: DigitsDataModule) -> None:
    for dataset in (digits.train_dataset, digits.val_dataset):
        assert set(dataset.tensors[1].tolist()) == set(range(DIGITS_N_CLASSES))


def test_train_split_is_standardised(digits: DigitsDataModule) -> None:
    x = digits.train_dataset.tensors[0].double()
    assert math.isclose(x.mean().item(), 0.0, abs_tol=1e-6)
    assert math.isclose(x.std(correction=0).item(), 1.0, abs_tol=1e-6)


def test_same_seed_gives_same_batches_and_drop_last(digits: DigitsDataModule) -> None:
    other = DigitsDataModule(batch_size=BATCH, val_batch_size=256, seed=3)
    first = list(digits.host_train_dataloader())
    second = list(other.host_train_dataloader())
    assert len(first) == digits.train_size // BATCH
    for (xa, ya), (xb, yb) in zip(first, second, strict=True):
        assert xa.shape[0] == BATCH
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    different = DigitsDataModule(batch_size=BATCH, val_batch_size=256, seed=4)
    assert not torch.equal(next(iter(different.host_train_dataloader()))[1], first[0][1])


def test_val_loader_covers_every_sample_in_order(digits: DigitsDataModule) -> None:
    ys = torch.cat([y for _, y in digits.host_val_dataloader()])
    assert torch.equal(ys, digits.val_dataset.tensors[1])


def test_split_ignores_shuffle_seed(digits: DigitsDataModule) -> None:
    other = DigitsDataModule(batch_size=BATCH, seed=99)
    assert torch.equal(other.val_dataset.tensors[0], digits.val_dataset.tensors[0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"val_batch_size": True}, "val_batch_size"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"val_fraction": float("nan")}, "val_fraction"),
        ({"seed": -1}, "seed"),
        ({"split_seed": 0.5}, "split_seed"),
    ],
)
def test_bad_args_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DigitsDataModule(**kwargs)  # type: ignore[arg-type]


def test_batch_larger_than_train_split_fails_at_setup() -> None:
    dm = DigitsDataModule(batch_size=N_DIGITS)
    with pytest.raises(ValueError, match="batch_size"):
        dm.setup()
