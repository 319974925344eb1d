"""A squeeze-and-excitation seed for CNN hosts.

The seed looks at the whole feature map once per channel (global average pool), passes
that ``[C]`` summary through a small bottleneck MLP and uses the result as a per-channel
scale on its input::

    delta = x * tanh(excite(silu(squeeze(mean_hw(x)))))

A seed's output is *added* to the host's activation (``h + alpha * delta``), so once
blended in the slot computes ``h * (1 + alpha * tanh(...))``: the classic SE recalibration,
centred on the identity. ``tanh`` rather than SE's usual ``sigmoid`` because ``tanh(0) == 0``:
with ``excite`` zero-initialised the seed's output is exactly zero at germination, as the
Blueprint contract requires, and the gradient reaching ``excite`` is not zero, so it learns.
SiLU rather than ReLU in the bottleneck: a slot's input usually follows a ReLU, so the
pooled summary is non-negative and a narrow ReLU bottleneck can start out entirely dead,
leaving ``excite``'s weights (and through them ``squeeze``) without a gradient for good.

CNN slots only: on a token host the mean over positions would let a token see later ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from esper.kasmina.blueprints import Blueprint, SlotShape
from esper.kasmina.blueprints.layers import channel_linear, zero_

#: Bottleneck width is ``channels // SE_REDUCTION`` (SE-Net uses 16; Esper's hosts are narrow).
SE_REDUCTION = 4


def _hidden(shape: SlotShape) -> int:
    return shape.channels // SE_REDUCTION


class SqueezeExcite(nn.Module):
    """``[B, C, H, W] -> [B, C, H, W]``: the input scaled per channel; zero at init."""

    def __init__(self, shape: SlotShape) -> None:
        super().__init__()
        hidden = _hidden(shape)
        # 1x1 convolutions on the pooled [B, C, 1, 1] map: Linear layers over channels.
        self.squeeze = channel_linear(shape, shape.channels, hidden)
        self.excite = zero_(channel_linear(shape, hidden, shape.channels))

    def forward(self, x: Tensor) -> Tensor:
        summary = x.mean(dim=(2, 3), keepdim=True)  # squeeze: [B, C, 1, 1]
        scale = torch.tanh(self.excite(F.silu(self.squeeze(summary))))
        return x * scale


def _param_count(shape: SlotShape) -> int:
    c, r = shape.channels, _hidden(shape)
    return (c * r + r) + (r * c + c)  # squeeze (weight + bias), excite (weight + bias)


def _shape_rule(shape: SlotShape) -> str | None:
    if shape.channels < SE_REDUCTION:
        return (
            f"a reduction of {SE_REDUCTION} needs at least {SE_REDUCTION} channels, "
            f"the slot has {shape.channels}"
        )
    return None


SQUEEZE_EXCITE = Blueprint(
    name="squeeze_excite",  # must equal the entry-point name in pyproject.toml
    host_kinds=frozenset({"cnn"}),
    build=SqueezeExcite,
    param_count=_param_count,
    shape_rule=_shape_rule,
    description=f"squeeze-and-excitation channel rescaling (reduction {SE_REDUCTION})",
)
