"""Optimizer settings (kasmina/optim.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from esper.kasmina import OptimConfig


@pytest.mark.parametrize("field", ["host_lr", "seed_lr"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -0.1, True, "0.1", None])
def test_bad_learning_rate_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"OptimConfig.{field}"):
        OptimConfig(**{field: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.1, 1.0, 1.5, "0.9", False])
def test_bad_momentum_raises_value_error_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"OptimConfig\.momentum"):
        OptimConfig(momentum=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [math.nan, math.inf, -1e-4, "0", None])
def test_bad_weight_decay_raises_value_error_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"OptimConfig\.weight_decay"):
        OptimConfig(weight_decay=value)  # type: ignore[arg-type]


def test_valid_edge_values_are_accepted() -> None:
    cfg = OptimConfig(host_lr=1, seed_lr=1e-6, momentum=0.0, weight_decay=0.0)
    assert cfg.host_lr == 1 and cfg.momentum == 0.0


def test_make_builds_sgd_with_the_given_lr_and_the_config_momentum_and_decay() -> None:
    cfg = OptimConfig(host_lr=0.1, seed_lr=0.01, momentum=0.5, weight_decay=1e-3)
    layer = nn.Linear(3, 2)
    opt = cfg.make(layer.parameters(), cfg.seed_lr)
    assert isinstance(opt, torch.optim.SGD)
    (group,) = opt.param_groups
    assert group["lr"] == 0.01
    assert group["momentum"] == 0.5
    assert group["weight_decay"] == 1e-3
    assert {id(p) for p in group["params"]} == {id(p) for p in layer.parameters()}
