"""Pooling a mapped host's maps with the envs folded into channels: functorch's values and
gradients bit for bit, without its copies between the env-first and env-second layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from esper.kasmina.hosts.cnn import max_pool_2x2
from esper.kasmina.hosts.folded import per_channel_folded
from tests.ops import OpCounter

G, B, C = 3, 4, 5


def _pool(x: Tensor) -> Tensor:
    return F.max_pool2d(x, 2)


def _conv_pool_conv(pool: object) -> object:
    """One env's conv, pool, conv, as a CNN host's stages run under ``vmap``."""

    def forward(w1: Tensor, w2: Tensor, x: Tensor) -> Tensor:
        h = F.conv2d(x, w1, padding=1)
        h = pool(h)  # type: ignore[operator]
        return F.conv2d(h, w2, padding=1)

    return forward


def _weights() -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    w1 = torch.randn(G, C, 3, 3, 3, requires_grad=True)
    w2 = torch.randn(G, C, C, 3, 3, requires_grad=True)
    # Rounded values make tied windows, where a pool's backward must pick as torch does.
    x = torch.randn(G, B, 3, 8, 8).mul(2).round()
    return w1, w2, x


def _run(pool: object) -> tuple[Tensor, Tensor, Tensor, OpCounter]:
    w1, w2, x = _weights()
    counter = OpCounter()
    with counter:
        out = vmap(_conv_pool_conv(pool))(w1, w2, x)
        out.square().sum().backward()
    assert w1.grad is not None and w2.grad is not None
    return out.detach(), w1.grad, w2.grad, counter


def test_a_folded_pool_gives_functorchs_outputs_and_gradients_bit_for_bit() -> None:
    out, g1, g2, _ = _run(_pool)
    folded_out, folded_g1, folded_g2, _ = _run(lambda h: per_channel_folded(h, _pool))
    assert torch.equal(folded_out, out)
    assert torch.equal(folded_g1, g1)
    assert torch.equal(folded_g2, g2)


def test_a_folded_pool_leaves_the_map_where_the_convolutions_put_it() -> None:
    """functorch's pool rule copies the conv's env-second map to env-first and the next
    conv copies it back, forward and backward; folded, the one copy left is the first
    conv's of its input, which comes env-first."""
    *_, batched = _run(_pool)
    *_, folded = _run(lambda h: per_channel_folded(h, _pool))
    assert batched.ops["clone"] >= 3
    assert folded.ops["clone"] == 1
    assert folded.ops["max_pool2d_with_indices"] == 1


@pytest.mark.parametrize("grad", [True, False])
def test_the_cpus_pooling_shortcut_runs_folded_only_where_no_gradient_is_needed(
    grad: bool,
) -> None:
    """Unwrapped, the stacked map says whether it needs a gradient (a mapped one does not):
    the maximum of quarters where none is needed, ``F.max_pool2d`` where one is."""
    w1, _, x = _weights()
    w1.requires_grad_(grad)

    def forward(w: Tensor, x: Tensor) -> Tensor:
        return per_channel_folded(F.conv2d(x, w, padding=1), max_pool_2x2)

    counter = OpCounter()
    with counter:
        out = vmap(forward)(w1, x)
    expected = vmap(lambda w, x: _pool(F.conv2d(x, w, padding=1)))(w1, x)
    assert torch.equal(out, expected)
    assert (counter.ops["max_pool2d_with_indices"] == 1) is grad
    assert (counter.ops["maximum"] == 3) is not grad


def test_outside_vmap_or_on_an_unmapped_tensor_the_op_runs_as_it_is() -> None:
    x = torch.randn(B, C, 6, 6)
    assert torch.equal(per_channel_folded(x, _pool), _pool(x))

    def forward(w: Tensor, x: Tensor) -> Tensor:
        return per_channel_folded(x, _pool) * w.sum()  # x is shared by every env

    w = torch.ones(G, 2)
    out = vmap(forward, in_dims=(0, None))(w, x)
    assert torch.equal(out, _pool(x).expand(G, *_pool(x).shape) * 2)
