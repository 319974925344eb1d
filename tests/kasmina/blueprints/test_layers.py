"""Per-position building blocks shared by blueprints (kasmina/blueprints/layers.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from esper.kasmina.blueprints.layers import (
    ToTokens,
    channel_linear,
    channel_norm,
    n_params,
    zero_,
)
from esper.kasmina.blueprints.spec import SlotShape

CNN = SlotShape("cnn", 6, (3, 3))
TOKENS = SlotShape("transformer", 6, (5,), causal=True)


def test_channel_linear_is_a_1x1_conv_on_feature_maps_and_a_linear_on_tokens() -> None:
    conv = channel_linear(CNN, 6, 4)
    lin = channel_linear(TOKENS, 6, 4)
    assert isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1)
    assert isinstance(lin, nn.Linear)
    assert n_params(conv) == n_params(lin) == 6 * 4 + 4
    assert n_params(channel_linear(CNN, 6, 4, bias=False)) == 24


def test_channel_linear_is_the_same_map_for_both_layouts() -> None:
    conv = channel_linear(CNN, 6, 4)
    lin = channel_linear(TOKENS, 6, 4)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.view(4, 6))
        lin.bias.copy_(conv.bias)
    x = torch.randn(2, 6, 3, 3)
    tokens = x.flatten(2).transpose(1, 2)
    assert torch.allclose(conv(x).flatten(2).transpose(1, 2), lin(tokens), atol=1e-6)


@pytest.mark.parametrize(("channels", "groups"), [(16, 8), (12, 4), (6, 2), (3, 1), (1, 1)])
def test_channel_norm_uses_the_largest_group_count_dividing_channels(
    channels: int, groups: int
) -> None:
    norm = channel_norm(SlotShape("cnn", channels, (2, 2)), channels)
    assert isinstance(norm, nn.GroupNorm)
    assert norm.num_groups == groups


def test_channel_norm_on_tokens_is_layer_norm() -> None:
    norm = channel_norm(TOKENS, 6)
    assert isinstance(norm, nn.LayerNorm)
    assert norm.normalized_shape == (6,)


def test_zero_zeroes_every_parameter_and_returns_the_module() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert zero_(module) is module
    assert all(not bool(p.any()) for p in module.parameters())


def test_to_tokens_round_trips_feature_maps_and_passes_tokens_through() -> None:
    seen: list[tuple[int, ...]] = []

    class Record(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(x.shape))
            return x

    wrapped = ToTokens(Record())
    x = torch.randn(2, 6, 3, 4)
    assert torch.equal(wrapped(x), x)
    assert seen == [(2, 12, 6)]
    t = torch.randn(2, 5, 6)
    assert torch.equal(wrapped(t), t)
    assert seen[-1] == (2, 5, 6)


def test_to_tokens_puts_channels_last_per_pixel() -> None:
    class FirstChannelOnly(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(x)
            out[..., 0] = x[..., 0]
            return out

    x = torch.randn(1, 3, 2, 2)
    y = ToTokens(FirstChannelOnly())(x)
    assert torch.equal(y[:, 0], x[:, 0])
    assert not bool(y[:, 1:].any())
