"""Synthetic Gaussian images: deterministic, balanced, separable."""

from __future__ import annotations

import pytest
import torch

from esper.tolaria.data import SyntheticImageDataModule

BATCH = 16


def test_shapes_and_balance() -> None:
    dm = SyntheticImageDataModule(
        input_shape=[3, 4, 4], n_classes=5, n_train=53, n_val=20, batch_size=BATCH
    )
    x, y = dm.train_dataset.tensors
    assert dm.input_shape == (3, 4, 4) and dm.n_classes == 5 and dm.task == "classification"
    assert x.shape == (53, 3, 4, 4) and x.dtype == torch.float32 and y.dtype == torch.int64
    counts = torch.bincount(y, minlength=5)
    assert counts.max() - counts.min() <= 1
    assert set(dm.val_dataset.tensors[1].tolist()) == set(range(5))
    batches = list(dm.host_train_dataloader())
    assert len(batches) == 53 // BATCH and all(b[0].shape[0] == BATCH for b in batches)


def test_deterministic_for_data_seed_and_independent_of_shuffle_seed() -> None:
    a = SyntheticImageDataModule(batch_size=BATCH, seed=0)
    b = SyntheticImageDataModule(batch_size=BATCH, seed=7)
    c = SyntheticImageDataModule(batch_size=BATCH, data_seed=1)
    for split in ("train_dataset", "val_dataset"):
        for ta, tb in zip(getattr(a, split).tensors, getattr(b, split).tensors, strict=True):
            assert torch.equal(ta, tb)
    assert not torch.equal(a.train_dataset.tensors[0], c.train_dataset.tensors[0])
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


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_shape": ()}, "input_shape"),
        ({"input_shape": (1, 0, 8)}, r"input_shape\[1\]"),
        ({"input_shape": "1x8x8"}, "input_shape"),
        ({"n_classes": 1}, "n_classes"),
        ({"n_train": 3}, "n_train"),
        ({"n_val": 0}, "n_val"),
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
