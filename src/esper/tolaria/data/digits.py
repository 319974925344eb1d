"""The embedded default data: scikit-learn's bundled 8x8 handwritten digits.

It ships inside scikit-learn, so a first run needs no download and no data folder,
and it is small enough for CPU-only smoke runs while still being a real task.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

from esper.contracts.config_errors import require_int
from esper.tolaria.data.base import (
    TASK_CLASSIFICATION,
    DataSplits,
    HostDataModule,
    Task,
    held_out_fractions,
)

DIGITS_SHAPE: tuple[int, ...] = (1, 8, 8)
DIGITS_N_CLASSES = 10
DIGITS_PIXEL_MAX = 16.0
DEFAULT_VAL_FRACTION = 0.2
DEFAULT_TEST_FRACTION = 0.2
DEFAULT_SPLIT_SEED = 0
# Guards the division for a degenerate split; the real train split's std is about 0.38.
MIN_STD = 1e-8


class DataSplitIndices(NamedTuple):
    """Sorted sample indices of each split, into ``load_digits()``."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


class DigitsDataModule(HostDataModule):
    """1797 digits, split per class so all three splits keep the class balance.

    Per class, ``val_fraction`` of the samples go to validation, ``test_fraction`` to
    test and the rest to train. Validation is what the run itself reads (reward,
    observations, gates, checkpoint choice); test is held out from all of that, for
    evaluation to report. The split has its own ``split_seed`` so runs that vary ``seed``
    (the shuffle order) are still scored on the very same validation and test images;
    the validation images depend on ``val_fraction`` and ``split_seed`` only, so changing
    ``test_fraction`` moves images between test and train, never into or out of
    validation. With the defaults: 1079 train, 359 validation and 359 test images.

    Attributes:
        split_indices: filled by ``setup``: each split's indices into scikit-learn's
            ``load_digits()`` (sorted), to look at the images or check the split.

    Args:
        val_fraction: fraction of each class held out for validation, strictly between 0
            and 1; val_fraction + test_fraction must stay below 1.
        test_fraction: fraction of each class held out for the test split (read only by
            evaluation), strictly between 0 and 1; val_fraction + test_fraction must stay
            below 1.
        split_seed: seed of the train/validation/test split; keep it fixed to compare
            runs on the same validation and test images.
        loading: the loaders' ``batch_size``, ``val_batch_size``, ``num_workers`` and
            ``seed``, as :class:`~esper.tolaria.data.base.HostDataModule` takes them.
    """

    def __init__(
        self,
        *,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        test_fraction: float = DEFAULT_TEST_FRACTION,
        split_seed: int = DEFAULT_SPLIT_SEED,
        **loading: Any,
    ) -> None:
        super().__init__(**loading)
        self.val_fraction, self.test_fraction = held_out_fractions(val_fraction, test_fraction)
        self.split_seed = require_int("split_seed", split_seed, 0)
        self.split_indices: DataSplitIndices | None = None

    @property
    def task(self) -> Task:
        return TASK_CLASSIFICATION

    @property
    def input_shape(self) -> tuple[int, ...]:
        return DIGITS_SHAPE

    @property
    def n_classes(self) -> int:
        return DIGITS_N_CLASSES

    def _build_datasets(self) -> DataSplits:
        # Imported here: scikit-learn is slow to import and only this module needs it.
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = np.asarray(bunch.images, dtype=np.float64) / DIGITS_PIXEL_MAX
        labels = np.asarray(bunch.target, dtype=np.int64)
        indices = _stratified_split(labels, self.val_fraction, self.test_fraction, self.split_seed)
        self.split_indices = indices

        # Statistics from the train split only, so neither held-out split leaks into training.
        mean = float(images[indices.train].mean())
        std = max(float(images[indices.train].std()), MIN_STD)
        standardised = ((images - mean) / std).astype(np.float32)
        x = torch.from_numpy(standardised).reshape(-1, *DIGITS_SHAPE)
        y = torch.from_numpy(labels)

        def subset(idx: np.ndarray) -> TensorDataset:
            rows = torch.from_numpy(idx)
            return TensorDataset(x[rows], y[rows])

        return DataSplits(subset(indices.train), subset(indices.val), subset(indices.test))


def _stratified_split(
    labels: np.ndarray, val_fraction: float, test_fraction: float, split_seed: int
) -> DataSplitIndices:
    """Per class, ``round(fraction * count)`` samples each to validation and test.

    Each class is permuted by ``split_seed``; validation takes the front of the
    permutation, test the next part and train the rest. Validation thus depends on
    ``val_fraction`` and ``split_seed`` only (it is the split Esper had before the test
    split existed). The clamps keep at least one sample of every class in every split,
    even for extreme fractions. Indices come back sorted so the split depends only on
    the seed.
    """
    rng = np.random.default_rng(split_seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in DataSplitIndices._fields}
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        count = len(members)  # about 180 per digit, so every clamp below has room
        n_val = min(max(round(val_fraction * count), 1), count - 2)
        n_test = min(max(round(test_fraction * count), 1), count - n_val - 1)
        parts["val"].append(members[:n_val])
        parts["test"].append(members[n_val : n_val + n_test])
        parts["train"].append(members[n_val + n_test :])
    return DataSplitIndices(
        **{name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}
    )
