"""Building blocks shared by blueprints: per-position linear maps for either host kind.

A 1x1 convolution on ``[B, C, H, W]`` and a Linear on ``[B, T, D]`` are the same map
over channels with the same parameter count, so most blueprints are written once.
"""

from __future__ import annotations

from torch import Tensor, nn

from esper.kasmina.blueprints.spec import SlotShape

#: Group counts tried, largest first, for GroupNorm over conv channels.
NORM_GROUP_CHOICES: tuple[int, ...] = (8, 4, 2, 1)


def channel_linear(shape: SlotShape, c_in: int, c_out: int, bias: bool = True) -> nn.Module:
    if shape.kind == "cnn":
        return nn.Conv2d(c_in, c_out, kernel_size=1, bias=bias)
    return nn.Linear(c_in, c_out, bias=bias)


def channel_norm(shape: SlotShape, channels: int) -> nn.Module:
    """Normalisation over channels: GroupNorm for feature maps, LayerNorm for tokens."""
    if shape.kind == "cnn":
        groups = next(g for g in NORM_GROUP_CHOICES if channels % g == 0)
        return nn.GroupNorm(groups, channels)
    return nn.LayerNorm(channels)


def zero_(module: nn.Module) -> nn.Module:
    """Zero every parameter of ``module``: the output layer of a freshly planted seed."""
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


def n_params(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


class ToTokens(nn.Module):
    """``[B, C, H, W] -> [B, H*W, C]`` for token-wise blueprints on a CNN slot, and back."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            return self.inner(x)
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        return self.inner(tokens).transpose(1, 2).reshape(b, c, h, w)
