"""Batch norm in a stacked step: each env's own norm, bit for bit, in one fused op."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from esper.tolaria.stacked_norm import batch_norms, batch_norms_unfolded, unfolded_forward
from tests.ops import OpCounter

G = 3


def _norms(kind: type[nn.modules.batchnorm._BatchNorm], channels: int) -> list[nn.Module]:
    """G norms with different weights, biases and statistics, as a fit leaves envs."""
    torch.manual_seed(0)
    norms = []
    for _ in range(G):
        norm = kind(channels)
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
        norms.append(norm)
    return norms


def _stacked(norms: list[nn.Module]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params = {
        name: torch.stack([dict(n.named_parameters())[name].detach() for n in norms])
        .clone()
        .requires_grad_()
        for name, _ in norms[0].named_parameters()
    }
    buffers = {
        name: torch.stack([dict(n.named_buffers())[name] for n in norms]).clone()
        for name, _ in norms[0].named_buffers()
    }
    return params, buffers


@pytest.mark.parametrize(
    ("kind", "shape", "exact"),
    [
        (nn.BatchNorm2d, (5, 4, 6, 6), True),  # the hosts' feature maps: bit for bit
        (nn.BatchNorm1d, (5, 4, 3), True),
        (nn.BatchNorm1d, (7, 4), False),  # torch's 2-d kernel sums G*C columns differently
    ],
)
def test_a_mapped_norm_gives_each_envs_own_output_gradients_and_statistics(
    kind: type[nn.modules.batchnorm._BatchNorm], shape: tuple[int, ...], exact: bool
) -> None:
    def same(a: Tensor, b: Tensor) -> None:
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)

    norms = _norms(kind, shape[1])
    x = torch.randn(G, *shape)
    params, buffers = _stacked(norms)
    template = norms[0]

    def loss(p: dict[str, Tensor], b: dict[str, Tensor], xs: Tensor) -> Tensor:
        return functional_call(template, (p, b), (xs,))

    stacked_x = (x * 1.0).requires_grad_()
    with batch_norms_unfolded([template]):
        out = vmap(loss)(params, buffers, stacked_x)
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    for g, norm in enumerate(norms):
        own_x = x[g].clone().requires_grad_()
        own = norm(own_x)
        (own * weights[g]).sum().backward()
        same(out[g].detach(), own.detach())
        assert stacked_x.grad is not None and own_x.grad is not None
        same(stacked_x.grad[g], own_x.grad)
        for name, p in norm.named_parameters():
            same(params[name].grad[g], p.grad)
        for name, b in norm.named_buffers():
            same(buffers[name][g], b)


def test_in_evaluation_each_env_normalises_by_its_own_statistics_exactly() -> None:
    norms = [norm.eval() for norm in _norms(nn.BatchNorm2d, 4)]
    params, buffers = _stacked(norms)
    before = {name: b.clone() for name, b in buffers.items()}
    x = torch.randn(5, 4, 6, 6)  # one batch for every env, as validation gives it

    def run(p: dict[str, Tensor], b: dict[str, Tensor], xs: Tensor) -> Tensor:
        return functional_call(norms[0], (p, b), (xs,))

    with torch.no_grad(), batch_norms_unfolded(norms[:1]):
        out = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    for g, norm in enumerate(norms):
        with torch.no_grad():
            assert torch.equal(out[g], norm(x))
    for name, b in buffers.items():
        assert torch.equal(b, before[name]), name  # nothing moves in evaluation


def test_it_runs_one_fused_norm_with_no_filled_weight_or_separate_affine() -> None:
    norms = _norms(nn.BatchNorm2d, 4)
    params, buffers = _stacked(norms)
    x = torch.randn(G, 5, 4, 6, 6)

    def run(unfolded: bool) -> collections.Counter[str]:
        def loss(p: dict[str, Tensor], b: dict[str, Tensor], xs: Tensor) -> Tensor:
            return functional_call(norms[0], (p, b), (xs,))

        counter = OpCounter()
        with counter:
            if unfolded:
                with batch_norms_unfolded(norms[:1]):
                    vmap(loss)(params, buffers, x).sum().backward()
            else:
                vmap(loss)(params, buffers, x).sum().backward()
        return counter.ops

    unfolded, batched = run(True), run(False)
    assert batched["ones"] == batched["zeros"] == 1  # functorch's rule fills a weight and bias
    assert unfolded["ones"] == unfolded["zeros"] == 0
    assert unfolded["native_batch_norm"] == unfolded["native_batch_norm_backward"] == 1
    assert sum(unfolded.values()) < sum(batched.values())


def test_each_norms_batch_counter_moves_once_per_call_as_the_block_ends() -> None:
    norms = _norms(nn.BatchNorm2d, 4)
    params, buffers = _stacked(norms)
    x = torch.randn(G, 5, 4, 6, 6)

    def twice(p: dict[str, Tensor], b: dict[str, Tensor], xs: Tensor) -> Tensor:
        once = functional_call(norms[0], (p, b), (xs,))
        return functional_call(norms[0], (p, b), (once,))

    counter = buffers["num_batches_tracked"]
    counter.copy_(torch.arange(G))  # envs at different counts
    with batch_norms_unfolded(norms[:1]):
        vmap(twice)(params, buffers, x)
        assert torch.equal(counter, torch.arange(G))  # not yet: one add as the block ends
    assert torch.equal(counter, torch.arange(G) + 2)


def test_outside_vmap_or_without_a_fixed_momentum_the_module_runs_as_always() -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 3, 4, 4)
    for configure in (lambda n: n, lambda n: n.eval(), lambda n: setattr(n, "momentum", None)):
        a, b = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        configure(a)
        configure(b)
        assert torch.equal(unfolded_forward(a, x), b(x))
        for (name, mine), theirs in zip(a.named_buffers(), b.buffers(), strict=True):
            assert torch.equal(mine, theirs), name


def test_the_block_restores_each_norms_own_forward_even_when_it_raises() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SyncBatchNorm(4))
    norms = batch_norms(model)
    assert norms == [model[1]]  # a synchronised norm's statistics cross processes: left alone
    with pytest.raises(RuntimeError, match="inside"), batch_norms_unfolded(norms):
        assert "forward" in vars(model[1])
        raise RuntimeError("inside")
    assert "forward" not in vars(model[1])


def test_a_norm_whose_weight_is_shared_by_the_envs_runs_through_vmaps_own_rule() -> None:
    norms = _norms(nn.BatchNorm2d, 4)
    params, buffers = _stacked(norms)
    shared = {name: p[0].detach() for name, p in params.items()}  # one weight for all
    x = torch.randn(G, 5, 4, 6, 6)
    before = {name: b.clone() for name, b in buffers.items()}

    def loss(p: dict[str, Tensor], b: dict[str, Tensor], xs: Tensor) -> Tensor:
        return functional_call(norms[0], (p, b), (xs,))

    with batch_norms_unfolded(norms[:1]):
        unfolded = vmap(loss, in_dims=(None, 0, 0))(shared, buffers, x)
    batched = vmap(loss, in_dims=(None, 0, 0))(shared, before, x)
    assert torch.equal(unfolded, batched)
    for name, b in buffers.items():
        assert torch.equal(b, before[name]), name
