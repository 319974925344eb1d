"""Convolutional blueprints (kasmina/blueprints/conv.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from esper.kasmina import BlueprintFitError
from esper.kasmina.blueprints.conv import BOTTLENECK_REDUCTION, WIDE_EXPANSION, conv_blueprints
from esper.kasmina.blueprints.spec import SlotShape

BY_NAME = {bp.name: bp for bp in conv_blueprints()}


def test_conv_blueprints_fit_cnn_slots_only() -> None:
    assert set(BY_NAME) == {
        "conv_light",
        "conv_heavy",
        "conv_wide",
        "depthwise",
        "bottleneck",
    }
    for bp in BY_NAME.values():
        assert bp.host_kinds == frozenset({"cnn"})


def test_conv_light_is_one_zeroed_same_padding_3x3_conv() -> None:
    module = BY_NAME["conv_light"].instantiate(SlotShape("cnn", 5, (7, 7)))
    assert isinstance(module, nn.Conv2d)
    assert module.kernel_size == (3, 3) and module.padding == (1, 1)
    assert not bool(module.weight.any())


def test_conv_wide_widens_inside_and_returns_to_the_slot_width_from_zero() -> None:
    module = BY_NAME["conv_wide"].instantiate(SlotShape("cnn", 3, (5, 5)))
    assert module[0].out_channels == WIDE_EXPANSION * 3
    assert module[-1].out_channels == 3
    assert not bool(module(torch.randn(2, 3, 5, 5)).any())


def test_depthwise_first_conv_is_grouped_per_channel() -> None:
    module = BY_NAME["depthwise"].instantiate(SlotShape("cnn", 8, (4, 4)))
    first = module[0]
    assert isinstance(first, nn.Conv2d)
    assert first.groups == 8


@pytest.mark.parametrize("channels", range(1, BOTTLENECK_REDUCTION))
def test_bottleneck_needs_enough_channels_to_reduce(channels: int) -> None:
    shape = SlotShape("cnn", channels, (4, 4))
    with pytest.raises(BlueprintFitError, match=f"needs at least {BOTTLENECK_REDUCTION} channels"):
        BY_NAME["bottleneck"].instantiate(shape)


def test_bottleneck_reduces_channels_by_its_factor() -> None:
    module = BY_NAME["bottleneck"].instantiate(SlotShape("cnn", 32, (4, 4)))
    assert module[0].out_channels == 32 // BOTTLENECK_REDUCTION
    assert module[-1].out_channels == 32


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_conv_seed_learns_a_nonzero_output_after_one_gradient_step(name: str) -> None:
    torch.manual_seed(0)
    shape = SlotShape("cnn", 8, (4, 4))
    module = BY_NAME[name].instantiate(shape)
    x = torch.randn(2, 8, 4, 4)
    target = torch.randn(2, 8, 4, 4)
    loss = (module(x) - target).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
        assert bool(module(x).abs().sum() > 0)
