"""Per-position and attention blueprints (kasmina/blueprints/channelwise.py)."""

from __future__ import annotations

import pytest
import torch

from esper.kasmina import BlueprintFitError
from esper.kasmina.blueprints.channelwise import (
    ATTENTION_HEAD_DIM,
    ATTENTION_MAX_TOKENS,
    LORA_RANK,
    SelfAttention,
    channelwise_blueprints,
)
from esper.kasmina.blueprints.spec import SlotShape

BY_NAME = {bp.name: bp for bp in channelwise_blueprints()}


def _nonzero_attention(shape: SlotShape) -> torch.nn.Module:
    torch.manual_seed(0)
    module = BY_NAME["attention"].instantiate(shape)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.3)
    return module


def test_channelwise_blueprints_fit_both_host_kinds() -> None:
    assert set(BY_NAME) == {"attention", "norm", "lora", "mlp"}
    for bp in BY_NAME.values():
        assert bp.host_kinds == frozenset({"cnn", "transformer"})


def test_attention_on_a_transformer_slot_is_causal() -> None:
    module = _nonzero_attention(SlotShape("transformer", 32, (6,), causal=True))
    x = torch.randn(1, 6, 32)
    changed = x.clone()
    changed[:, 4:] = torch.randn(1, 2, 32)
    with torch.no_grad():
        a, b = module(x), module(changed)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_attention_on_a_cnn_slot_mixes_all_pixels() -> None:
    module = _nonzero_attention(SlotShape("cnn", 16, (3, 3)))
    x = torch.randn(1, 16, 3, 3)
    changed = x.clone()
    changed[..., 2, 2] = torch.randn(16)
    with torch.no_grad():
        a, b = module(x), module(changed)
    assert not torch.allclose(a[..., 0, 0], b[..., 0, 0])


def test_attention_uses_heads_of_fixed_width() -> None:
    module = BY_NAME["attention"].instantiate(SlotShape("transformer", 64, (4,), causal=True))
    inner = module.inner
    assert isinstance(inner, SelfAttention)
    assert inner.n_heads == 64 // ATTENTION_HEAD_DIM


def test_attention_refuses_channels_off_head_width_and_too_many_positions() -> None:
    bp = BY_NAME["attention"]
    with pytest.raises(BlueprintFitError, match=f"multiple of the head width {ATTENTION_HEAD_DIM}"):
        bp.instantiate(SlotShape("transformer", ATTENTION_HEAD_DIM + 1, (4,), causal=True))
    assert bp.fits(SlotShape("cnn", 16, (32, 32)))  # exactly the limit
    with pytest.raises(BlueprintFitError, match=f"exceed the limit of {ATTENTION_MAX_TOKENS}"):
        bp.instantiate(SlotShape("cnn", 16, (33, 32)))


@pytest.mark.parametrize("channels", [1, LORA_RANK])
def test_lora_needs_more_channels_than_its_rank(channels: int) -> None:
    with pytest.raises(BlueprintFitError, match=f"rank-{LORA_RANK} adapter"):
        BY_NAME["lora"].instantiate(SlotShape("transformer", channels, (4,), causal=True))
    assert BY_NAME["lora"].fits(SlotShape("transformer", LORA_RANK + 1, (4,), causal=True))


@pytest.mark.parametrize("name", sorted(BY_NAME))
@pytest.mark.parametrize(
    "shape",
    [SlotShape("cnn", 16, (3, 3)), SlotShape("transformer", 16, (5,), causal=True)],
    ids=["cnn", "transformer"],
)
def test_channelwise_seed_learns_a_nonzero_output_after_one_gradient_step(
    name: str, shape: SlotShape
) -> None:
    torch.manual_seed(0)
    module = BY_NAME[name].instantiate(shape)
    if shape.kind == "cnn":
        x = torch.randn(2, shape.channels, *shape.spatial)
    else:
        x = torch.randn(2, *shape.spatial, shape.channels)
    loss = (module(x) - torch.randn_like(x)).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
        assert bool(module(x).abs().sum() > 0)
