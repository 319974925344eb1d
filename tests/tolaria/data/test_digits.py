"""The embedded digits data: real samples, balanced splits, reproducible loaders."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from esper.tolaria.data import DataSplits, DigitsDataModule
from esper.tolaria.data.digits import (
    DIGITS_N_CLASSES,
    DIGITS_PIXEL_MAX,
    DIGITS_SHAPE,
    DataSplitIndices,
)

N_DIGITS = 1797
BATCH = 64
SPLITS = DataSplits._fields
# What the defaults give (val_fraction = test_fraction = 0.2, rounded per class).
DEFAULT_SIZES = {"train": 1079, "val": 359, "test": 359}


@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    return DigitsDataModule(batch_size=BATCH, val_batch_size=256, seed=3)


def _tensors(dm: DigitsDataModule, split: str) -> tuple[torch.Tensor, ...]:
    return getattr(dm, f"{split}_dataset").tensors


def _indices(dm: DigitsDataModule) -> DataSplitIndices:
    dm.setup()
    assert dm.split_indices is not None
    return dm.split_indices


def test_loads_all_samples_with_shapes(digits: DigitsDataModule) -> None:
    assert digits.train_size + digits.val_size + digits.test_size == N_DIGITS
    for split in SPLITS:
        x, y = _tensors(digits, split)
        assert x.shape[1:] == DIGITS_SHAPE == digits.input_shape
        assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert digits.n_classes == DIGITS_N_CLASSES and digits.task == "classification"
    for size, fraction in ((digits.val_size, 0.2), (digits.test_size, 0.2)):
        assert abs(size - N_DIGITS * fraction) <= DIGITS_N_CLASSES


def test_default_split_sizes(digits: DigitsDataModule) -> None:
    sizes = {"train": digits.train_size, "val": digits.val_size, "test": digits.test_size}
    assert sizes == DEFAULT_SIZES


@pytest.mark.parametrize(("val_fraction", "test_fraction"), [(0.1, 0.3), (0.3, 0.05)])
def test_held_out_splits_are_sized_by_their_fractions(
    val_fraction: float, test_fraction: float
) -> None:
    dm = DigitsDataModule(val_fraction=val_fraction, test_fraction=test_fraction)
    assert abs(dm.val_size - N_DIGITS * val_fraction) <= DIGITS_N_CLASSES
    assert abs(dm.test_size - N_DIGITS * test_fraction) <= DIGITS_N_CLASSES
    assert dm.train_size == N_DIGITS - dm.val_size - dm.test_size


def test_every_split_holds_every_class(digits: DigitsDataModule) -> None:
    for split in SPLITS:
        assert set(_tensors(digits, split)[1].tolist()) == set(range(DIGITS_N_CLASSES))


def test_every_class_keeps_a_sample_in_every_split_at_extreme_fractions() -> None:
    dm = DigitsDataModule(val_fraction=0.001, test_fraction=0.998, batch_size=1)
    for split in SPLITS:
        assert set(_tensors(dm, split)[1].tolist()) == set(range(DIGITS_N_CLASSES))


def test_splits_are_disjoint_and_cover_every_sample_once(digits: DigitsDataModule) -> None:
    indices = _indices(digits)
    everything = np.concatenate(list(indices))
    assert len(everything) == N_DIGITS
    assert np.array_equal(np.sort(everything), np.arange(N_DIGITS))


def test_each_split_holds_the_samples_its_indices_name(digits: DigitsDataModule) -> None:
    indices = _indices(digits)
    labels = torch.from_numpy(load_digits().target)
    for split in SPLITS:
        rows = torch.from_numpy(getattr(indices, split))
        assert torch.equal(_tensors(digits, split)[1], labels[rows])
        assert len(rows) == len(getattr(digits, f"{split}_dataset"))


def test_train_split_is_standardised(digits: DigitsDataModule) -> None:
    x = digits.train_dataset.tensors[0].double()
    assert math.isclose(x.mean().item(), 0.0, abs_tol=1e-6)
    assert math.isclose(x.std(correction=0).item(), 1.0, abs_tol=1e-6)


def test_standardisation_uses_the_train_split_only(digits: DigitsDataModule) -> None:
    """The held-out images go through the train split's scaling, not their own."""
    indices = _indices(digits)
    images = load_digits().images / DIGITS_PIXEL_MAX
    train = images[indices.train]
    mean, std = train.mean(), train.std()
    expected = torch.from_numpy(((images[indices.test] - mean) / std).astype(np.float32))
    assert torch.allclose(digits.test_dataset.tensors[0].reshape(expected.shape), expected)


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


def test_test_loader_yields_the_whole_test_split_in_order(digits: DigitsDataModule) -> None:
    batches = list(digits.host_test_dataloader())
    assert len(batches) == math.ceil(digits.test_size / digits.val_batch_size)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert torch.equal(xs, digits.test_dataset.tensors[0])
    assert torch.equal(ys, digits.test_dataset.tensors[1])


def test_split_ignores_shuffle_seed(digits: DigitsDataModule) -> None:
    other = DigitsDataModule(batch_size=BATCH, seed=99)
    for split in SPLITS:
        for ta, tb in zip(_tensors(other, split), _tensors(digits, split), strict=True):
            assert torch.equal(ta, tb)


def test_split_seed_alone_moves_the_split() -> None:
    a = _indices(DigitsDataModule(split_seed=0))
    b = _indices(DigitsDataModule(split_seed=0, seed=5))
    c = _indices(DigitsDataModule(split_seed=1))
    for split in SPLITS:
        assert np.array_equal(getattr(a, split), getattr(b, split))
    assert not np.array_equal(a.test, c.test) and not np.array_equal(a.val, c.val)


def test_validation_images_do_not_depend_on_test_fraction() -> None:
    """Changing the test split moves images between test and train, never validation."""
    small = _indices(DigitsDataModule(test_fraction=0.05))
    large = _indices(DigitsDataModule(test_fraction=0.5))
    assert np.array_equal(small.val, large.val)
    assert set(small.test.tolist()) < set(large.test.tolist())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"val_batch_size": True}, "val_batch_size"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"val_fraction": float("nan")}, "val_fraction"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"test_fraction": "0.2"}, "test_fraction"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "test_fraction"),
        ({"seed": -1}, "seed"),
        ({"split_seed": 0.5}, "split_seed"),
    ],
)
def test_bad_args_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DigitsDataModule(**kwargs)  # type: ignore[arg-type]


def test_fractions_that_leave_no_train_data_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        DigitsDataModule(val_fraction=0.6, test_fraction=0.4)
    message = str(info.value)
    assert message.startswith("DigitsDataModule.test_fraction: ")
    assert "val_fraction + test_fraction < 1" in message


def test_batch_larger_than_train_split_fails_at_setup() -> None:
    dm = DigitsDataModule(batch_size=N_DIGITS)
    with pytest.raises(ValueError, match="batch_size"):
        dm.setup()
