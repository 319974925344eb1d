"""The embedded default data: scikit-learn's bundled 8x8 handwritten digits.

It ships inside scikit-learn, so a first run needs no download and no data folder,
and it is small enough for CPU-only smoke runs while still being a real task.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from esper.contracts.config_errors import require_int, require_number
from esper.tolaria.data.base import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_NUM_WORKERS,
    DEFAULT_SEED,
    DEFAULT_VAL_BATCH_SIZE,
    TASK_CLASSIFICATION,
    HostDataModule,
    Task,
)

DIGITS_SHAPE: tuple[int, ...] = (1, 8, 8)
DIGITS_N_CLASSES = 10
DIGITS_PIXEL_MAX = 16.0
DEFAULT_VAL_FRACTION = 0.2
DEFAULT_SPLIT_SEED = 0
# Guards the division for a degenerate split; the real train split's std is about 0.38.
MIN_STD = 1e-8


class DigitsDataModule(HostDataModule):
    """1797 digits, split per class so both splits keep the class balance.

    The split has its own ``split_seed`` so runs that vary ``seed`` (the shuffle
    order) are still scored on the very same validation images.

    Args:
        val_fraction: fraction of each class held out for validation, strictly between 0
            and 1.
        split_seed: seed of the train/validation split; keep it fixed to compare runs on
            the same validation images.
    """

    def __init__(
        self,
        *,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        split_seed: int = DEFAULT_SPLIT_SEED,
        batch_size: int = DEFAULT_BATCH_SIZE,
        val_batch_size: int = DEFAULT_VAL_BATCH_SIZE,
        num_workers: int = DEFAULT_NUM_WORKERS,
        seed: int = DEFAULT_SEED,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            num_workers=num_workers,
            seed=seed,
        )
        require_number("val_fraction", val_fraction, above=0.0, below=1.0)
        self.val_fraction = float(val_fraction)
        self.split_seed = require_int("split_seed", split_seed, 0)

    @property
    def task(self) -> Task:
        return TASK_CLASSIFICATION

    @property
    def input_shape(self) -> tuple[int, ...]:
        return DIGITS_SHAPE

    @property
    def n_classes(self) -> int:
        return DIGITS_N_CLASSES

    def _build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        # Imported here: scikit-learn is slow to import and only this module needs it.
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = np.asarray(bunch.images, dtype=np.float64) / DIGITS_PIXEL_MAX
        labels = np.asarray(bunch.target, dtype=np.int64)
        train_idx, val_idx = _stratified_split(labels, self.val_fraction, self.split_seed)

        # Statistics from the train split only, so validation never leaks into training.
        mean = float(images[train_idx].mean())
        std = max(float(images[train_idx].std()), MIN_STD)
        standardised = ((images - mean) / std).astype(np.float32)
        x = torch.from_numpy(standardised).reshape(-1, *DIGITS_SHAPE)
        y = torch.from_numpy(labels)
        train_t, val_t = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
        return TensorDataset(x[train_t], y[train_t]), TensorDataset(x[val_t], y[val_t])


def _stratified_split(
    labels: np.ndarray, val_fraction: float, split_seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per class, hold out ``round(val_fraction * count)`` samples, at least one each way.

    The clamp keeps both splits non-empty and every class present in both, even for
    extreme fractions. Indices come back sorted so the split depends only on the seed.
    """
    rng = np.random.default_rng(split_seed)
    train_parts: list[np.ndarray] = []
    val_parts: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_val = min(max(round(val_fraction * len(members)), 1), len(members) - 1)
        val_parts.append(members[:n_val])
        train_parts.append(members[n_val:])
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(val_parts))
