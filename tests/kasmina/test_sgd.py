"""sgd_step: the optimizers of one env stepped together, bit-identical to torch's step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from esper.kasmina.sgd import clear_grads, sgd_step


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 5))


def _optimizers(
    net: nn.Module, lrs: tuple[float, float], momentum: float, weight_decay: float
) -> list[torch.optim.Optimizer]:
    """Two optimizers as an env holds them: the "host" with two groups (one per layer, the
    second at the first's learning rate, as a fossilized seed's group is), the "seed"'s
    own at another learning rate."""
    conv, bn, _, head = net
    host = torch.optim.SGD(
        list(conv.parameters()), lr=lrs[0], momentum=momentum, weight_decay=weight_decay
    )
    host.add_param_group({"params": list(head.parameters())})
    seed = torch.optim.SGD(
        list(bn.parameters()), lr=lrs[1], momentum=momentum, weight_decay=weight_decay
    )
    return [host, seed]


def _train(
    net: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    step: str,
    steps: int,
    frozen: nn.Parameter | None = None,
    device: str = "cpu",
) -> None:
    """``steps`` steps on fixed random data, each optimizer stepped by its own ``step`` or
    all of them by :func:`sgd_step`; ``frozen`` gets no gradient until the last step."""
    gen = torch.Generator().manual_seed(7)
    for k in range(steps):
        if step == "torch":
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
        else:
            clear_grads(optimizers)
        x = torch.randn(6, 3, 6, 6, generator=gen).to(device)
        y = torch.randint(0, 5, (6,), generator=gen).to(device)
        nn.functional.cross_entropy(net(x), y).backward()
        if frozen is not None and k < steps - 1:
            frozen.grad = None  # no gradient yet: its momentum buffer starts later
        if step == "torch":
            for opt in optimizers:
                opt.step()
        else:
            sgd_step(optimizers)


def _assert_same(a: nn.Module, b: nn.Module, oa: list, ob: list) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    for opt_a, opt_b in zip(oa, ob, strict=True):
        sa, sb = opt_a.state_dict(), opt_b.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for k, state in sa["state"].items():
            assert state.keys() == sb["state"][k].keys()
            for key, value in state.items():
                assert torch.equal(value, sb["state"][k][key]), (k, key)


@settings(max_examples=25, deadline=None)
@given(
    lrs=st.tuples(st.sampled_from([0.1, 0.05, 1e-3]), st.sampled_from([0.1, 0.05, 1e-3])),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    weight_decay=st.sampled_from([0.0, 5e-4, 1e-2]),
    steps=st.integers(1, 4),
    late_grad=st.booleans(),
)
def test_sgd_step_is_bit_identical_to_each_optimizers_step(
    lrs: tuple[float, float], momentum: float, weight_decay: float, steps: int, late_grad: bool
) -> None:
    """Parameters, buffers and optimizer state dicts (the momentum buffers a checkpoint
    holds) equal torch's after every step, also for a parameter whose first gradient comes
    late (its buffer starts as a copy of that gradient while the others' already run)."""
    ref, mine = _net(0), _net(0)
    ref_opts = _optimizers(ref, lrs, momentum, weight_decay)
    my_opts = _optimizers(mine, lrs, momentum, weight_decay)
    _train(ref, ref_opts, "torch", steps, ref[0].bias if late_grad else None)
    _train(mine, my_opts, "sgd_step", steps, mine[0].bias if late_grad else None)
    _assert_same(ref, mine, ref_opts, my_opts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("torch_foreach", [None, False], ids=["torch-default", "single-tensor"])
@pytest.mark.parametrize("late_grad", [False, True])
def test_on_cuda_sgd_step_is_bit_identical_to_torch_s_step(
    torch_foreach: bool | None, late_grad: bool
) -> None:
    """On CUDA torch steps SGD with its multi-tensor ops by default; sgd_step equals both
    that and its one-tensor-at-a-time path there."""
    ref, mine = _net(0).cuda(), _net(0).cuda()
    ref_opts = _optimizers(ref, (0.05, 0.1), 0.9, 5e-4)
    my_opts = _optimizers(mine, (0.05, 0.1), 0.9, 5e-4)
    for opt in (*ref_opts, *my_opts):  # sgd_step ignores it; set alike, state dicts compare
        for group in opt.param_groups:
            group["foreach"] = torch_foreach
    _train(ref, ref_opts, "torch", 4, ref[0].bias if late_grad else None, device="cuda")
    _train(mine, my_opts, "sgd_step", 4, mine[0].bias if late_grad else None, device="cuda")
    _assert_same(ref, mine, ref_opts, my_opts)


def test_state_saved_by_torch_resumes_under_sgd_step() -> None:
    """A state dict written while torch stepped loads and goes on under sgd_step exactly as
    under torch: the momentum buffers live where torch keeps them."""
    net = _net(1)
    opts = _optimizers(net, (0.05, 0.1), 0.9, 5e-4)
    _train(net, opts, "torch", 3)
    ref_net, mine = copy.deepcopy(net), copy.deepcopy(net)
    ref_opts = _optimizers(ref_net, (0.05, 0.1), 0.9, 5e-4)
    my_opts = _optimizers(mine, (0.05, 0.1), 0.9, 5e-4)
    for ref_opt, my_opt, saved in zip(ref_opts, my_opts, opts, strict=True):
        # Loading keeps the saved tensors: each optimizer gets its own copy of them.
        ref_opt.load_state_dict(copy.deepcopy(saved.state_dict()))
        my_opt.load_state_dict(copy.deepcopy(saved.state_dict()))
    _train(ref_net, ref_opts, "torch", 2)
    _train(mine, my_opts, "sgd_step", 2)
    _assert_same(ref_net, mine, ref_opts, my_opts)


def test_parameters_without_gradients_are_left_alone() -> None:
    net = _net(2)
    opts = _optimizers(net, (0.05, 0.05), 0.9, 5e-4)
    before = copy.deepcopy(net.state_dict())
    sgd_step(opts)  # no gradients at all
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(not opt.state for opt in opts)


def test_a_step_that_runs_out_of_memory_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever of the step's allocations fails (the weight-decayed gradients of each
    setting, the copy that starts a late parameter's momentum buffer), no parameter,
    momentum buffer or optimizer state has moved: a stacked group that runs out of memory
    retrains that batch env by env from there (esper.tolaria.stacked)."""
    net = _net(5)
    opts = _optimizers(net, (0.05, 0.1), 0.9, 5e-4)
    _train(net, opts, "torch", 2)
    del opts[0].state[net[0].bias]  # as a parameter before its first gradient
    x, y = torch.randn(6, 3, 6, 6), torch.randint(0, 5, (6,))
    nn.functional.cross_entropy(net(x), y).backward()
    real_add, real_clone = torch._foreach_add, torch.Tensor.clone
    allocations = {"made": 0, "fail_at": 0}

    def counted(real: Callable[..., object]) -> Callable[..., object]:
        def allocate(*args: object, **kwargs: object) -> object:
            allocations["made"] += 1
            if allocations["made"] == allocations["fail_at"]:
                raise torch.OutOfMemoryError("simulated")
            return real(*args, **kwargs)

        return allocate

    monkeypatch.setattr(torch, "_foreach_add", counted(real_add))
    monkeypatch.setattr(torch.Tensor, "clone", counted(real_clone))
    before_net, before_opts = copy.deepcopy((net, opts))
    total = 3  # two settings' decayed gradients, one buffer started: counted below
    for fail_at in range(1, total + 1):
        allocations.update(made=0, fail_at=fail_at)
        with pytest.raises(torch.OutOfMemoryError):
            sgd_step(opts)
        _assert_same(before_net, net, before_opts, opts)
    allocations.update(made=0, fail_at=0)
    sgd_step(opts)
    assert allocations["made"] == total
    assert not torch.equal(net[0].bias, before_net[0].bias)  # the step itself moves it
    assert "momentum_buffer" in opts[0].state[net[0].bias]


def test_clear_grads_sets_every_gradient_to_none() -> None:
    net = _net(3)
    opts = _optimizers(net, (0.05, 0.05), 0.9, 0.0)
    _train(net, opts, "torch", 1)
    assert any(p.grad is not None for p in net.parameters())
    clear_grads(opts)
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1), "dampening=0.1"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize=True"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), "SGD only, got Adam"),
    ],
)
def test_other_optimizers_are_refused_not_stepped_differently(make, match: str) -> None:
    net = _net(4)
    opt = make(list(net.parameters()))
    with pytest.raises((ValueError, TypeError), match=match):
        sgd_step([opt])
