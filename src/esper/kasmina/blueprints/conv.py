"""Convolutional blueprints: seeds for the feature maps of CNN hosts."""

from __future__ import annotations

from torch import nn

from esper.kasmina.blueprints.layers import channel_norm, zero_
from esper.kasmina.blueprints.spec import Blueprint, SlotShape

CNN = frozenset({"cnn"})
KERNEL = 3
KERNEL_AREA = KERNEL * KERNEL
#: Bottleneck width is channels // BOTTLENECK_REDUCTION.
BOTTLENECK_REDUCTION = 4
#: Hidden width of a wide seed is channels * WIDE_EXPANSION: the one blueprint that adds
#: capacity a narrow host lacks rather than depth at the host's own width.
WIDE_EXPANSION = 4


def _conv(
    c_in: int, c_out: int, *, kernel: int = KERNEL, groups: int = 1, bias: bool = True
) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, groups=groups, bias=bias)


def _conv_light(s: SlotShape) -> nn.Module:
    return zero_(_conv(s.channels, s.channels))


def _conv_heavy(s: SlotShape) -> nn.Module:
    c = s.channels
    return nn.Sequential(_conv(c, c, bias=False), channel_norm(s, c), nn.ReLU(), zero_(_conv(c, c)))


def _conv_wide(s: SlotShape) -> nn.Module:
    c, w = s.channels, WIDE_EXPANSION * s.channels
    return nn.Sequential(_conv(c, w, bias=False), channel_norm(s, w), nn.ReLU(), zero_(_conv(w, c)))


def _depthwise(s: SlotShape) -> nn.Module:
    c = s.channels
    return nn.Sequential(_conv(c, c, groups=c), nn.ReLU(), zero_(_conv(c, c, kernel=1)))


def _bottleneck_width(s: SlotShape) -> int:
    return s.channels // BOTTLENECK_REDUCTION


def _bottleneck(s: SlotShape) -> nn.Module:
    c, r = s.channels, _bottleneck_width(s)
    return nn.Sequential(
        _conv(c, r, kernel=1), nn.ReLU(), _conv(r, r), nn.ReLU(), zero_(_conv(r, c, kernel=1))
    )


def _bottleneck_rule(s: SlotShape) -> str | None:
    if s.channels < BOTTLENECK_REDUCTION:
        return f"needs at least {BOTTLENECK_REDUCTION} channels, the slot has {s.channels}"
    return None


def conv_blueprints() -> list[Blueprint]:
    def norm_params(c: int) -> int:
        return 2 * c

    return [
        Blueprint(
            "conv_light",
            CNN,
            _conv_light,
            lambda s: KERNEL_AREA * s.channels**2 + s.channels,
            description="one 3x3 convolution",
        ),
        Blueprint(
            "conv_heavy",
            CNN,
            _conv_heavy,
            lambda s: 2 * KERNEL_AREA * s.channels**2 + norm_params(s.channels) + s.channels,
            description="3x3 conv, norm, ReLU, 3x3 conv",
        ),
        Blueprint(
            "conv_wide",
            CNN,
            _conv_wide,
            lambda s: (
                2 * KERNEL_AREA * WIDE_EXPANSION * s.channels**2
                + norm_params(WIDE_EXPANSION * s.channels)
                + s.channels
            ),
            description=f"3x3 conv to {WIDE_EXPANSION}x the channels, norm, ReLU, 3x3 conv back",
        ),
        Blueprint(
            "depthwise",
            CNN,
            _depthwise,
            lambda s: KERNEL_AREA * s.channels + s.channels + s.channels**2 + s.channels,
            description="depthwise 3x3 then pointwise 1x1",
        ),
        Blueprint(
            "bottleneck",
            CNN,
            _bottleneck,
            lambda s: (
                s.channels * _bottleneck_width(s)
                + _bottleneck_width(s)
                + KERNEL_AREA * _bottleneck_width(s) ** 2
                + _bottleneck_width(s)
                + _bottleneck_width(s) * s.channels
                + s.channels
            ),
            shape_rule=_bottleneck_rule,
            description="1x1 reduce, 3x3, 1x1 expand",
        ),
    ]
