"""What every data module shares (tolaria/data/base.py): the loader arguments it passes
on to HostDataModule, and the record of everything it was built with."""

from __future__ import annotations

import pytest

from esper.contracts.config_errors import ConfigError
from esper.tolaria.data import (
    DigitsDataModule,
    SyntheticImageDataModule,
    TokenSequenceDataModule,
)

LOADING = {"batch_size": 64, "val_batch_size": 256, "num_workers": 0, "seed": 3}


@pytest.mark.parametrize(
    "cls", [DigitsDataModule, SyntheticImageDataModule, TokenSequenceDataModule]
)
def test_loader_arguments_reach_the_base_and_the_record(cls: type) -> None:
    data = cls(**LOADING)
    assert {k: getattr(data, k) for k in LOADING} == LOADING
    assert {k: data.init_args[k] for k in LOADING} == LOADING


def test_the_record_holds_every_argument_with_its_default_in_signature_order() -> None:
    data = DigitsDataModule(split_seed=2, batch_size=32)
    assert data.init_args == {
        "val_fraction": 0.2,
        "test_fraction": 0.2,
        "split_seed": 2,
        "batch_size": 32,
        "val_batch_size": 512,
        "num_workers": 0,
        "seed": 0,
        "resident_bytes": 2**30,
    }
    assert DigitsDataModule(**data.init_args).init_args == data.init_args  # rebuilds alike


def test_a_bad_loader_argument_names_the_subclass_and_the_field() -> None:
    with pytest.raises(ConfigError, match=r"DigitsDataModule\.batch_size: must be an int >= 1"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(TypeError, match="batch_sise"):
        DigitsDataModule(batch_sise=8)  # type: ignore[call-arg]
