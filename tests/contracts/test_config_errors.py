"""ConfigError and the checks that raise it: the key, the owner, the allowed values."""

from __future__ import annotations

import math
import pickle

import pytest

from esper.contracts.config_errors import (
    ConfigError,
    owned_by,
    require_bool,
    require_choice,
    require_int,
    require_number,
)


class _Config:
    """Stands for any config class that owns its errors."""


def _message(check: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        check(*args, **kwargs)  # type: ignore[operator]
    assert info.value.owner is None and str(info.value).startswith(f"{info.value.key}: ")
    return info.value.message


def test_an_error_reads_key_then_message_and_is_a_value_error() -> None:
    error = ConfigError("clip_coef", "must be > 0", _Config)
    assert isinstance(error, ValueError)
    assert str(error) == "_Config.clip_coef: must be > 0"
    placed = error.under("model.ppo")
    assert (placed.key, placed.owner, str(placed)) == (
        "model.ppo.clip_coef",
        None,
        "model.ppo.clip_coef: must be > 0",
    )
    assert str(ConfigError("", "is empty").under("data")) == "data: is empty"


def test_owned_by_names_the_config_class_and_keeps_an_existing_owner() -> None:
    with pytest.raises(ConfigError) as info, owned_by(_Config()):
        require_int("size", 0, 1)
    assert info.value.owner is _Config and str(info.value).startswith("_Config.size: ")
    with pytest.raises(ConfigError) as info, owned_by(object()):
        raise ConfigError("size", "must be >= 1", _Config)
    assert info.value.owner is _Config


@pytest.mark.parametrize("bad", [0, True, 2.0, "3", None])
def test_require_int_refuses_what_is_not_an_int_in_range(bad: object) -> None:
    assert _message(require_int, "n", bad, 1, "one per env") == (
        f"must be an int >= 1, got {bad!r}; one per env"
    )


def test_require_int_returns_the_int() -> None:
    assert require_int("n", 3, 1) == 3


@pytest.mark.parametrize(
    ("bounds", "bad", "stated"),
    [
        ({"above": 0.0}, 0.0, "> 0"),
        ({"at_least": 0.0}, -1e-3, ">= 0"),
        ({"below": 1.0}, 1.0, "< 1"),
        ({"at_most": 1.0}, 2, "<= 1"),
        ({"at_least": 0.0, "at_most": 1.0}, 1.5, "in [0, 1]"),
        ({"at_least": 0.0, "below": 1.0}, 1.0, "in [0, 1)"),
        ({"above": 0.0, "below": 1.0}, 0.0, "in (0, 1)"),
        ({}, math.nan, ""),
        ({}, math.inf, ""),
        ({}, True, ""),
        ({}, "0.5", ""),
    ],
)
def test_require_number_states_the_allowed_range(
    bounds: dict[str, float], bad: object, stated: str
) -> None:
    range_text = f" {stated}" if stated else ""
    assert _message(require_number, "x", bad, **bounds) == (
        f"must be a finite number{range_text}, got {bad!r}"
    )


def test_require_number_lets_none_through_only_when_it_means_something() -> None:
    require_number("target_kl", None, above=0.0, null="disable it")
    require_number("target_kl", 0.5, above=0.0, null="disable it")
    assert _message(require_number, "target_kl", 0.0, above=0.0, null="disable it") == (
        "must be a finite number > 0, or None (null) to disable it; got 0.0"
    )
    assert "got None" in _message(require_number, "lr", None, above=0.0)


def test_require_choice_and_require_bool_list_the_allowed_values() -> None:
    require_choice("amp", "off", ("off", "bf16"))
    assert _message(require_choice, "amp", "x", ("off", "bf16")) == (
        "must be one of ['off', 'bf16'], got 'x'"
    )
    assert _message(require_choice, "host", "resnet", ("cnn",), "registered hosts") == (
        "must be one of the registered hosts ['cnn'], got 'resnet'"
    )
    assert require_bool("anneal_lr", False) is False
    assert _message(require_bool, "anneal_lr", 1) == "must be true or false, got 1"


def test_an_owned_error_keeps_its_key_and_owner_through_pickling() -> None:
    with pytest.raises(ConfigError) as info, owned_by(_Config()):
        require_int("size", 0, 1)
    error = pickle.loads(pickle.dumps(info.value))
    assert (error.key, error.owner, str(error)) == (
        "size",
        _Config,
        "_Config.size: must be an int >= 1, got 0",
    )
