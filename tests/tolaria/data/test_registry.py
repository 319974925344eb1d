"""The data-module registry: built-ins present, non-data-modules refused."""

from __future__ import annotations

import pytest

from esper.tolaria.data import (
    DATAMODULES,
    Cifar10DataModule,
    DigitsDataModule,
    HostDataModule,
    SyntheticImageDataModule,
    TokenSequenceDataModule,
)


def test_builtins_are_registered() -> None:
    assert DATAMODULES.group == "esper.datamodules"
    expected = {
        "digits": DigitsDataModule,
        "cifar10": Cifar10DataModule,
        "synthetic": SyntheticImageDataModule,
        "tokens": TokenSequenceDataModule,
    }
    assert set(expected) <= set(DATAMODULES.names())
    for name, cls in expected.items():
        assert DATAMODULES.get(name) is cls
        assert issubclass(cls, HostDataModule)


@pytest.mark.parametrize("obj", [int, object(), DigitsDataModule(), "digits"])
def test_rejects_non_datamodules(obj: object) -> None:
    with pytest.raises(TypeError, match="HostDataModule"):
        DATAMODULES.register("not_a_datamodule", obj)  # type: ignore[arg-type]
    assert "not_a_datamodule" not in DATAMODULES


def test_unknown_name_lists_known() -> None:
    with pytest.raises(KeyError, match="digits"):
        DATAMODULES.get("imagenet")
