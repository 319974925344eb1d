"""Seeded Gaussian class-conditional images: a task that builds in milliseconds for tests.

Each class has a random prototype image; a sample is its class prototype plus
Gaussian noise. With the defaults the prototypes lie far apart relative to the noise,
so even a tiny host learns the task quickly, and any shape or class count can be
asked for to exercise hosts and slots without touching a real data set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset

from esper.contracts.config_errors import ConfigError, require_int, require_number
from esper.tolaria.data.base import (
    TASK_CLASSIFICATION,
    DataSplits,
    HostDataModule,
    Task,
)

DEFAULT_SYNTHETIC_SHAPE: tuple[int, ...] = (1, 8, 8)
DEFAULT_SYNTHETIC_N_CLASSES = 4
DEFAULT_SYNTHETIC_N_TRAIN = 512
DEFAULT_SYNTHETIC_N_VAL = 128
DEFAULT_SYNTHETIC_N_TEST = 128
DEFAULT_NOISE_STD = 1.0
DEFAULT_CLASS_SEPARATION = 1.0
DEFAULT_DATA_SEED = 0
MIN_N_CLASSES = 2


class SyntheticImageDataModule(HostDataModule):
    """``x = separation * prototype[y] + noise_std * N(0, 1)``, float32 ``[N, *input_shape]``.

    Labels cycle through the classes before shuffling, so every split is balanced to
    within one sample and holds every class (hence ``n_train, n_val, n_test >=
    n_classes``). The data come from ``data_seed`` alone, separate from the loader's
    shuffle ``seed``, so runs that vary the shuffle still see the very same samples.
    One generator draws the prototypes, then the train, validation and test samples in
    that order: the test samples are fresh draws, and adding them left the train and
    validation samples exactly what they were before the test split existed.

    Args:
        input_shape: shape of one sample, such as [1, 8, 8] (channels, height, width) or
            [features]; the host is built for it.
        n_classes: number of classes (at least 2), each with its own random prototype.
        n_train: training samples; at least n_classes.
        n_val: validation samples; at least n_classes.
        n_test: held-out test samples, read only by evaluation; at least n_classes.
        noise_std: standard deviation of the noise added to the prototype; raise it for
            a harder task.
        class_separation: scale of the class prototypes; lower it to bring the classes
            closer (a harder task).
        data_seed: seed of the prototypes and samples, separate from the shuffle seed.
        loading: the loaders' ``batch_size``, ``val_batch_size``, ``num_workers`` and
            ``seed``, as :class:`~esper.tolaria.data.base.HostDataModule` takes them.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int] = DEFAULT_SYNTHETIC_SHAPE,
        n_classes: int = DEFAULT_SYNTHETIC_N_CLASSES,
        n_train: int = DEFAULT_SYNTHETIC_N_TRAIN,
        n_val: int = DEFAULT_SYNTHETIC_N_VAL,
        n_test: int = DEFAULT_SYNTHETIC_N_TEST,
        noise_std: float = DEFAULT_NOISE_STD,
        class_separation: float = DEFAULT_CLASS_SEPARATION,
        data_seed: int = DEFAULT_DATA_SEED,
        **loading: Any,
    ) -> None:
        super().__init__(**loading)
        self._input_shape = _validate_shape(input_shape)
        self._n_classes = require_int("n_classes", n_classes, MIN_N_CLASSES)
        # Every class in every split, so accuracy and per-class checks are meaningful.
        every_class = "at least one sample of every class"
        self.n_train = require_int("n_train", n_train, self._n_classes, every_class)
        self.n_val = require_int("n_val", n_val, self._n_classes, every_class)
        self.n_test = require_int("n_test", n_test, self._n_classes, every_class)
        require_number("noise_std", noise_std, above=0.0)
        require_number("class_separation", class_separation, above=0.0)
        self.noise_std, self.class_separation = float(noise_std), float(class_separation)
        self.data_seed = require_int("data_seed", data_seed, 0)
        # Filled by ``setup``: the class prototypes (already scaled), for tests and probes.
        self.class_means: torch.Tensor | None = None

    @property
    def task(self) -> Task:
        return TASK_CLASSIFICATION

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self._input_shape

    @property
    def n_classes(self) -> int:
        return self._n_classes

    def _build_datasets(self) -> DataSplits:
        generator = torch.Generator().manual_seed(self.data_seed)
        means = self.class_separation * torch.randn(
            self._n_classes, *self._input_shape, generator=generator
        )
        self.class_means = means
        # In this order: drawing test last keeps train and val what they were without it.
        train = self._sample(means, self.n_train, generator)
        val = self._sample(means, self.n_val, generator)
        test = self._sample(means, self.n_test, generator)
        return DataSplits(train, val, test)

    def _sample(self, means: torch.Tensor, n: int, generator: torch.Generator) -> TensorDataset:
        labels = torch.arange(n) % self._n_classes
        labels = labels[torch.randperm(n, generator=generator)]
        noise = torch.randn(n, *self._input_shape, generator=generator)
        x = means[labels] + self.noise_std * noise
        return TensorDataset(x.to(torch.float32), labels.to(torch.int64))


def _validate_shape(shape: object) -> tuple[int, ...]:
    """A non-empty sequence of positive ints, e.g. ``(C, H, W)`` or ``(features,)``."""
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence) or len(shape) == 0:
        raise ConfigError(
            "input_shape",
            f"must be a non-empty sequence of positive ints such as "
            f"{list(DEFAULT_SYNTHETIC_SHAPE)}, got {shape!r}",
        )
    return tuple(require_int(f"input_shape[{i}]", dim, 1) for i, dim in enumerate(shape))
