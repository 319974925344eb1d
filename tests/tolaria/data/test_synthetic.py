"""Synthetic Gaussian images: deterministic, balanced, separable."""

from __future__ import annotations

import math

import pytest
import torch

from esper.tolaria.data import DataSplits, SyntheticImageDataModule

BATCH = 16
SPLITS = DataSplits._fields


def _tensors(dm: SyntheticImageDataModule, split: str) -> tuple[torch.Tensor, ...]:
    return getattr(dm, f"{split}_dataset").tensors


def test_shapes_and_balance() -> None:
    dm = SyntheticImageDataModule(
        input_shape=[3, 4, 4], n_classes=5, n_train=53, n_val=20, n_test=12, batch_size=BATCH
    )
    assert dm.input_shape == (3, 4, 4) and dm.n_classes == 5 and dm.task == "classification"
    for split, n in zip(SPLITS, (53, 20, 12), strict=True):
        x, y = _tensors(dm, split)
        assert x.shape == (n, 3, 4, 4) and x.dtype == torch.float32 and y.dtype == torch.int64
        counts = torch.bincount(y, minlength=5)
        assert counts.max() - counts.min() <= 1 and counts.min() >= 1
    assert (dm.train_size, dm.val_size, dm.test_size) == (53, 20, 12)
    batches = list(dm.host_train_dataloader())
    assert len(batches) == 53 // BATCH and all(b[0].shape[0] == BATCH for b in batches)


def test_deterministic_for_data_seed_and_independent_of_shuffle_seed() -> None:
    a = SyntheticImageDataModule(batch_size=BATCH, seed=0)
    b = SyntheticImageDataModule(batch_size=BATCH, seed=7)
    c = SyntheticImageDataModule(batch_size=BATCH, data_seed=1)
    for split in SPLITS:
        for ta, tb in zip(_tensors(a, split), _tensors(b, split), strict=True):
            assert torch.equal(ta, tb)
        assert not torch.equal(_tensors(a, split)[0], _tensors(c, split)[0])
    first_a = next(iter(a.host_train_dataloader()))[1]
    assert torch.equal(first_a, next(iter(a.host_train_dataloader()))[1])


def test_class_means_differ_and_nearest_mean_classifies_val() -> None:
    dm = SyntheticImageDataModule(batch_size=BATCH)
    x, y = dm.train_dataset.tensors
    flat = x.flatten(1)
    means = torch.stack([flat[y == c].mean(0) for c in range(dm.n_classes)])
    gaps = torch.cdist(means, means) + torch.eye(dm.n_classes) * 1e9
    assert gaps.min() > 1.0  # well above the per-dimension noise scale of the mean
    vx, vy = dm.val_dataset.tensors
    predicted = torch.cdist(vx.flatten(1), means).argmin(1)
    assert (predicted == vy).float().mean() > 0.9


def test_adding_the_test_split_leaves_train_and_val_samples_unchanged() -> None:
    """Test samples are drawn after train and val: their size moves neither."""
    few = SyntheticImageDataModule(n_test=4, batch_size=BATCH)
    many = SyntheticImageDataModule(n_test=300, batch_size=BATCH)
    for split in ("train", "val"):
        for ta, tb in zip(_tensors(few, split), _tensors(many, split), strict=True):
            assert torch.equal(ta, tb)
    assert few.test_size == 4 and many.test_size == 300


def test_train_and_val_samples_are_what_they_were_before_the_test_split() -> None:
    """The generator replays the recipe used before test existed: prototypes, train, val."""
    dm = SyntheticImageDataModule(n_train=40, n_val=24, batch_size=BATCH)
    generator = torch.Generator().manual_seed(dm.data_seed)
    means = dm.class_separation * torch.randn(dm.n_classes, *dm.input_shape, generator=generator)
    for split, n in (("train", 40), ("val", 24)):
        labels = (torch.arange(n) % dm.n_classes)[torch.randperm(n, generator=generator)]
        noise = torch.randn(n, *dm.input_shape, generator=generator)
        x, y = _tensors(dm, split)
        assert torch.equal(y, labels) and torch.equal(x, means[labels] + dm.noise_std * noise)


def test_test_samples_are_fresh_draws_not_copies_of_other_splits() -> None:
    dm = SyntheticImageDataModule(n_train=64, n_val=64, n_test=64, batch_size=BATCH)
    test_x = dm.test_dataset.tensors[0].flatten(1)
    for split in ("train", "val"):
        other = _tensors(dm, split)[0].flatten(1)
        # Continuous noise: no test sample coincides with any sample of another split.
        assert torch.cdist(test_x, other).min() > 0


def test_test_loader_yields_the_whole_test_split_in_order() -> None:
    dm = SyntheticImageDataModule(n_test=70, batch_size=BATCH, val_batch_size=32)
    batches = list(dm.host_test_dataloader())
    assert [len(y) for _, y in batches] == [32, 32, 6]
    assert len(batches) == math.ceil(dm.test_size / dm.val_batch_size)
    assert torch.equal(torch.cat([x for x, _ in batches]), dm.test_dataset.tensors[0])
    assert torch.equal(torch.cat([y for _, y in batches]), dm.test_dataset.tensors[1])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_shape": ()}, "input_shape"),
        ({"input_shape": (1, 0, 8)}, r"input_shape\[1\]"),
        ({"input_shape": "1x8x8"}, "input_shape"),
        ({"n_classes": 1}, "n_classes"),
        ({"n_train": 3}, "n_train"),
        ({"n_val": 0}, "n_val"),
        ({"n_test": 3}, "n_test"),
        ({"n_test": 8.0}, "n_test"),
        ({"noise_std": float("nan")}, "noise_std"),
        ({"noise_std": 0.0}, "noise_std"),
        ({"class_separation": float("inf")}, "class_separation"),
        ({"data_seed": -1}, "data_seed"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_args_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticImageDataModule(**kwargs)  # type: ignore[arg-type]
