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


def test_cosine_schedule_runs_from_the_base_rate_down_to_the_final_fraction() -> None:
    cfg = OptimConfig(final_lr_fraction=0.1)
    assert cfg.lr_factor(0.0) == pytest.approx(1.0)
    assert cfg.lr_factor(0.5) == pytest.approx(0.55)
    assert cfg.lr_factor(1.0) == pytest.approx(0.1)
    factors = [cfg.lr_factor(p / 10) for p in range(11)]
    assert factors == sorted(factors, reverse=True)
    assert OptimConfig(lr_schedule="constant").lr_factor(0.9) == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr_schedule", "linear"),
        ("final_lr_fraction", -0.1),
        ("final_lr_fraction", 1.5),
        ("final_lr_fraction", True),
    ],
)
def test_bad_schedule_settings_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"OptimConfig\.{field}"):
        OptimConfig(**{field: value})


def test_set_progress_moves_every_optimizer_and_new_ones_start_on_schedule() -> None:
    from esper.contracts import BlendMode
    from esper.kasmina import GrowingHost
    from esper.kasmina.lifecycle import GateSignals
    from tests.kasmina.factories import FAST, make_host

    cfg = OptimConfig(host_lr=0.1, seed_lr=0.2, final_lr_fraction=0.0)
    grown = GrowingHost(make_host("cnn", lifecycle=FAST), cfg)
    first, second = grown.slot_ids[:2]
    grown.germinate(first, "conv_light", BlendMode.LINEAR)
    grown.set_progress(0.5)
    grown.germinate(second, "conv_light", BlendMode.LINEAR)  # planted mid-schedule
    half = cfg.lr_factor(0.5)
    assert grown.host_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * half)
    for slot_id in (first, second):
        assert grown.seed_optimizers[slot_id].param_groups[0]["lr"] == pytest.approx(0.2 * half)

    while grown.model.slot(first).stage.name != "FOSSILIZED":
        if not grown.advance(first, GateSignals(contribution=1.0)):
            grown.end_epoch()
    fossil_group = grown.host_optimizer.param_groups[-1]
    assert fossil_group["lr"] == pytest.approx(0.1 * half)  # joins at the host's rate
    grown.set_progress(1.0)
    assert all(g["lr"] == 0.0 for g in grown.host_optimizer.param_groups)
