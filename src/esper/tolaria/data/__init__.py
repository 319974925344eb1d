"""Host data modules and their registry (entry-point group ``esper.datamodules``).

A data-module plugin is a :class:`HostDataModule` subclass, built with keyword
arguments from the config; it builds :class:`DataSplits` (train, val and a held-out
test split that only evaluation reads). Built-ins: ``digits`` (embedded, no download),
``cifar10`` (needs the python-pickle release on disk), ``synthetic`` (Gaussian images
for tests) and ``tokens`` (next-token sequences for the Transformer host).
"""

from __future__ import annotations

from esper.plugins import Registry
from esper.tolaria.data.base import (
    TASK_CLASSIFICATION,
    TASK_LANGUAGE_MODEL,
    DataSplits,
    HostDataModule,
    Task,
)
from esper.tolaria.data.cifar10 import CIFAR10_URL, Cifar10DataModule
from esper.tolaria.data.digits import DigitsDataModule
from esper.tolaria.data.synthetic import SyntheticImageDataModule
from esper.tolaria.data.tokens import TokenSequenceDataModule


def _as_datamodule_class(name: str, obj: object) -> type[HostDataModule]:
    """Only classes: the config builds each run's module with its own keyword arguments."""
    if not (isinstance(obj, type) and issubclass(obj, HostDataModule)):
        raise TypeError(
            f"datamodule {name!r} must be a subclass of "
            f"esper.tolaria.data.HostDataModule (the class, not an instance), got {obj!r}"
        )
    return obj


DATAMODULES: Registry[type[HostDataModule]] = Registry(
    "esper.datamodules", "datamodule", validate=_as_datamodule_class
)
DATAMODULES.register("digits", DigitsDataModule)
DATAMODULES.register("cifar10", Cifar10DataModule)
DATAMODULES.register("synthetic", SyntheticImageDataModule)
DATAMODULES.register("tokens", TokenSequenceDataModule)

__all__ = [
    "CIFAR10_URL",
    "DATAMODULES",
    "TASK_CLASSIFICATION",
    "TASK_LANGUAGE_MODEL",
    "Cifar10DataModule",
    "DataSplits",
    "DigitsDataModule",
    "HostDataModule",
    "SyntheticImageDataModule",
    "Task",
    "TokenSequenceDataModule",
]
