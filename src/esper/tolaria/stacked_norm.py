"""Batch norm in a stacked step: the envs folded into channels, one fused kernel.

Why: under ``torch.func.vmap`` a batch norm whose weight, bias and running statistics are
stacked per env (as ``esper.tolaria.stacked`` stacks them) goes through functorch's batch
rule, which runs the norm without its affine part on a weight of ones and a bias of zeros
it fills each call, then multiplies by the weight and adds the bias as two more ops; their
backward takes four more. On a launch-bound GPU that is eight extra kernels per norm per
pass, and the split affine rounds differently from the fused kernel each env's own step
runs. A batch norm normalises each channel over the batch and spatial positions, so G
envs' ``[b, C, ...]`` activations are exactly a ``[b, G*C, ...]`` activation with G*C
channels: one ``F.batch_norm`` on that, with the stacked weight, bias and statistics viewed
as ``[G*C]``, computes every env's norm, updates every env's statistics in place, and
gives what each env's own step gives: bit for bit on the CPU for feature maps (the hosts'
``BatchNorm2d``), within float rounding for a 2-d input, whose kernel sums the wider rows
in another order (``tests/tolaria/test_stacked_norm.py``).

Inside ``vmap`` the mapped tensors are unwrapped to their stacked form and the result
wrapped back, as torch's own ``torch.library.register_vmap`` does (the same functorch
calls, without its per-call argument flattening, which cost more Python than the norm).
In evaluation (a stacked validation) the same fold normalises with each env's running
statistics. Where it does not apply (not under ``vmap``, an unmapped tensor, statistics
that are not one contiguous block, no running statistics, a cumulative average in
training), the module runs as it always does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._C import _functorch

#: Excluding this key runs ops on the unwrapped (stacked) tensors below the vmap level,
#: as torch's ``register_vmap`` helper does.
_BELOW_VMAP = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch norms of ``model`` that :func:`batch_norms_unfolded` can run (not
    ``SyncBatchNorm``, whose statistics cross processes)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]


#: Per stacked batch counter (by its address): the counter and how many batches it saw.
Counted = dict[int, tuple[Tensor, int]]


@contextmanager
def batch_norms_unfolded(norms: Sequence[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """Within the block, each of ``norms`` runs as :func:`unfolded_forward` (an attribute on
    the instance, removed afterwards, also when the block raises). The norms' batch
    counters (``num_batches_tracked``) move as the block ends, by one multi-tensor add,
    not an add each: they steer nothing within a step at a fixed momentum."""
    counted: Counted = {}
    for norm in norms:
        norm.forward = _unfolded(norm, counted)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for norm in norms:
            del norm.forward
        if counted:
            counters = [counter for counter, _ in counted.values()]
            with torch.no_grad():
                torch._foreach_add_(counters, [batches for _, batches in counted.values()])


def _unfolded(
    norm: nn.modules.batchnorm._BatchNorm, counted: Counted
) -> Callable[[Tensor], Tensor]:
    def forward(x: Tensor) -> Tensor:
        return unfolded_forward(norm, x, counted)

    return forward


def unfolded_forward(
    norm: nn.modules.batchnorm._BatchNorm, x: Tensor, counted: Counted | None = None
) -> Tensor:
    """``norm(x)``, with the envs folded into channels where ``x`` is mapped by ``vmap``
    and ``norm`` has running statistics (in training, at a fixed momentum); else its own
    forward. In training its batch counter moves here, or, given ``counted``, is entered
    there (stacked) for the caller to move."""
    level = _functorch.maybe_current_level()
    if (
        level is None
        or not norm.track_running_stats
        or (norm.training and norm.momentum is None)
        or norm.running_mean is None
        or norm.running_var is None
    ):
        return type(norm).forward(norm, x)
    norm._check_input_dim(x)
    out = _folded_batch_norm(norm, x, level)
    if out is None:
        return type(norm).forward(norm, x)
    counter = norm.num_batches_tracked
    if norm.training and counter is not None:
        stacked, dim = _functorch._unwrap_batched(counter, level)
        if counted is None or dim is None:
            counter.add_(1)
        else:  # the same counter twice (a norm run twice) is one entry: no racing adds
            _, batches = counted.get(stacked.data_ptr(), (stacked, 0))
            counted[stacked.data_ptr()] = (stacked, batches + 1)
    return out


def _folded_batch_norm(
    norm: nn.modules.batchnorm._BatchNorm, x: Tensor, level: int
) -> Tensor | None:
    """``norm`` of mapped ``x`` (logically ``[b, C, ...]``) with its tensors stacked
    ``[G, ...]`` along the vmap dimension: one ``F.batch_norm`` over ``[b, G*C, ...]``, in
    ``norm``'s mode. None where a tensor is not mapped at ``level`` or a statistic is not
    one contiguous ``[G, C]`` block (an in-place update must reach it)."""
    assert norm.running_mean is not None and norm.running_var is not None  # the caller's
    stacked_x, x_dim = _functorch._unwrap_batched(x, level)
    mean, mean_dim = _functorch._unwrap_batched(norm.running_mean, level)
    var, var_dim = _functorch._unwrap_batched(norm.running_var, level)
    if mean_dim != 0 or var_dim != 0 or not (mean.is_contiguous() and var.is_contiguous()):
        return None
    if x_dim is None:  # one input for every env (a validation batch before any layer)
        stacked_x, x_dim = stacked_x.expand(mean.shape[0], *stacked_x.shape), 0
    affine = []
    for tensor in (norm.weight, norm.bias):
        if tensor is None:
            affine.append(None)
            continue
        stacked, dim = _functorch._unwrap_batched(tensor, level)
        if dim is None:
            return None
        affine.append(stacked.movedim(dim, 0).reshape(-1))
    per_sample = stacked_x.movedim(x_dim, 1)  # [b, G, C, ...]
    b, g, c = per_sample.shape[:3]
    with torch._C._ExcludeDispatchKeyGuard(_BELOW_VMAP):
        out = F.batch_norm(
            per_sample.reshape(b, g * c, *per_sample.shape[3:]),
            mean.view(g * c),
            var.view(g * c),
            affine[0],
            affine[1],
            norm.training,
            0.0 if norm.momentum is None else norm.momentum,  # unused in evaluation
            norm.eps,
        )
    return _functorch._add_batch_dim(out.view(per_sample.shape), 1, level)
