"""Blueprints that act per position over channels, or attend across positions.

They fit both host kinds: on a CNN slot they see ``[B, C, H, W]`` (positions are
pixels), on a Transformer slot ``[B, T, D]`` (positions are tokens, attention causal).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from esper.kasmina.blueprints.layers import ToTokens, channel_linear, channel_norm, zero_
from esper.kasmina.blueprints.spec import Blueprint, SlotShape

BOTH = frozenset({"cnn", "transformer"})
#: Width of each attention head; a slot's channels must be a multiple of it.
ATTENTION_HEAD_DIM = 16
#: Attention over more positions than this would be quadratic-expensive for a seed.
ATTENTION_MAX_TOKENS = 1024
LORA_RANK = 4
MLP_EXPANSION = 2


class SelfAttention(nn.Module):
    """Pre-norm multi-head self-attention over ``[B, N, C]`` with a zeroed output projection."""

    def __init__(self, channels: int, causal: bool) -> None:
        super().__init__()
        self.n_heads = channels // ATTENTION_HEAD_DIM
        self.causal = causal
        self.norm = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = zero_(nn.Linear(channels, channels))

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, n, c))


def _attention(s: SlotShape) -> nn.Module:
    return ToTokens(SelfAttention(s.channels, causal=s.causal))


def _attention_rule(s: SlotShape) -> str | None:
    if s.channels % ATTENTION_HEAD_DIM:
        return f"channels ({s.channels}) must be a multiple of the head width {ATTENTION_HEAD_DIM}"
    if s.tokens > ATTENTION_MAX_TOKENS:
        return f"{s.tokens} positions exceed the limit of {ATTENTION_MAX_TOKENS}"
    return None


class ScaledNorm(nn.Module):
    """Normalised activation times a zero-initialised affine map: starts as exactly zero."""

    def __init__(self, s: SlotShape) -> None:
        super().__init__()
        self.norm = zero_(channel_norm(s, s.channels))

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x)


def _lora(s: SlotShape) -> nn.Module:
    return nn.Sequential(
        channel_linear(s, s.channels, LORA_RANK, bias=False),
        zero_(channel_linear(s, LORA_RANK, s.channels, bias=False)),
    )


def _lora_rule(s: SlotShape) -> str | None:
    if s.channels <= LORA_RANK:
        return f"a rank-{LORA_RANK} adapter needs more than {LORA_RANK} channels, got {s.channels}"
    return None


def _mlp(s: SlotShape) -> nn.Module:
    hidden = MLP_EXPANSION * s.channels
    return nn.Sequential(
        channel_linear(s, s.channels, hidden),
        nn.GELU(),
        zero_(channel_linear(s, hidden, s.channels)),
    )


def channelwise_blueprints() -> list[Blueprint]:
    return [
        Blueprint(
            "attention",
            BOTH,
            _attention,
            lambda s: (
                2 * s.channels + 3 * s.channels**2 + 3 * s.channels + s.channels**2 + s.channels
            ),
            shape_rule=_attention_rule,
            description="pre-norm multi-head self-attention (causal on token hosts)",
        ),
        Blueprint(
            "norm",
            BOTH,
            ScaledNorm,
            lambda s: 2 * s.channels,
            description="channel normalisation with a learned, zero-initialised affine map",
        ),
        Blueprint(
            "lora",
            BOTH,
            _lora,
            lambda s: 2 * LORA_RANK * s.channels,
            shape_rule=_lora_rule,
            description=f"rank-{LORA_RANK} linear adapter over channels",
        ),
        Blueprint(
            "mlp",
            BOTH,
            _mlp,
            lambda s: 2 * MLP_EXPANSION * s.channels**2 + MLP_EXPANSION * s.channels + s.channels,
            description=f"per-position MLP with {MLP_EXPANSION}x expansion",
        ),
    ]
