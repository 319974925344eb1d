"""One SGD step, and one gradient reset, over all of an env's optimizers at once.

An env trains its host with one ``torch.optim.SGD`` and each live seed with another
(``esper.kasmina.growing_host``). Stepping them one by one costs, per optimizer and per
training step, a profiler record, the optimizer's hooks and a Python loop over its
parameters; on the CPU, envs train in worker threads that share the interpreter lock
(``esper.tolaria.parallel``), and that Python is time the other worker waits. Here the
parameters of every group that shares a learning rate, momentum and weight decay are
stepped together by ``torch._foreach_*`` ops: a handful of calls per step, whatever the
number of seeds.

The arithmetic is torch's SGD (``torch.optim.sgd``: weight decay added to the gradient,
momentum buffer started as a copy of the first gradient, then ``buf * momentum + grad``,
parameter ``- lr * buf``), op for op. On the CPU, where torch steps SGD one tensor at a
time, the ``_foreach`` ops run the same kernels tensor by tensor, and results are
bit-identical to calling each optimizer's ``step`` (``tests/kasmina/test_sgd.py``); on
CUDA they are the ops of torch's own multi-tensor SGD, its default there, and results
equal both that and its one-tensor path (the gpu-marked test, run on an H100). The
momentum buffers stay in each optimizer's ``state`` under torch's key, so optimizer state
dicts, and checkpoints, are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

#: torch's key for a parameter's momentum buffer in ``SGD.state``.
MOMENTUM_BUFFER = "momentum_buffer"
#: The state of a parameter with none yet, read without making an entry for it.
_NONE: dict[str, Tensor] = {}


@torch.no_grad()
def sgd_step(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """One step of every optimizer in ``optimizers``, equal to calling each one's ``step``.

    Only plain momentum SGD (no Nesterov, dampening or maximize: what
    ``esper.kasmina.optim.OptimConfig.make`` builds) is stepped this way; anything else
    raises rather than being stepped differently from torch.
    """
    batches: dict[tuple[float, float, float], tuple[list[Tensor], list[Tensor], list[dict]]] = {}
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(
                f"sgd_step steps torch.optim.SGD only, got {type(optimizer).__name__}: "
                "call its step() instead"
            )
        for group in optimizer.param_groups:
            if group["nesterov"] or group["dampening"] != 0 or group["maximize"]:
                raise ValueError(
                    "sgd_step steps plain momentum SGD only; this optimizer's group has "
                    f"nesterov={group['nesterov']}, dampening={group['dampening']}, "
                    f"maximize={group['maximize']}: call its step() instead"
                )
            key = (group["lr"], group["momentum"], group["weight_decay"])
            params, grads, states = batches.setdefault(key, ([], [], []))
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad)
                    states.append(optimizer.state)  # a defaultdict: read with .get
    steps = []
    for (lr, momentum, weight_decay), (params, grads, states) in batches.items():
        if not params:
            continue
        if weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        bufs: list[Tensor | None] = []
        fresh: dict[int, Tensor] = {}
        if momentum != 0:
            # An entry is made for a parameter only with its buffer, so a failed step
            # adds no empty one (what an optimizer's states hold goes into checkpoints).
            pairs = zip(params, states, strict=True)
            bufs = [state.get(p, _NONE).get(MOMENTUM_BUFFER) for p, state in pairs]
            fresh = {i: grads[i].detach().clone() for i, b in enumerate(bufs) if b is None}
        steps.append((lr, momentum, params, grads, states, bufs, fresh))
    # Every allocation is made: from here on only in-place updates, so a step that runs
    # out of memory has moved no parameter, momentum buffer or optimizer state (a
    # stacked group retrains that batch env by env: ``esper.tolaria.stacked``).
    for lr, momentum, params, grads, states, bufs, fresh in steps:
        if momentum != 0:
            grads = _momentum(params, grads, states, bufs, fresh, momentum)
        torch._foreach_add_(params, grads, alpha=-lr)


def _momentum(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    bufs: list[Tensor | None],
    fresh: dict[int, Tensor],
    momentum: float,
) -> list[Tensor]:
    """Each parameter's updated momentum buffer (``buf * momentum + grad``), written into
    its optimizer's ``state``: ``bufs`` holds each one's buffer, None where ``fresh``
    holds, by index, the copy of the gradient that starts it (its first step)."""
    if not fresh:
        moving: list[Tensor] = bufs  # type: ignore[assignment]  # none is None
        torch._foreach_mul_(moving, momentum)
        torch._foreach_add_(moving, grads)
        return moving
    updated: list[Tensor] = []
    moving, moving_grads = [], []
    for i, (p, grad, state, buf) in enumerate(zip(params, grads, states, bufs, strict=True)):
        if buf is None:
            state[p][MOMENTUM_BUFFER] = fresh[i]
            updated.append(fresh[i])
        else:
            updated.append(buf)
            moving.append(buf)
            moving_grads.append(grad)
    if moving:
        torch._foreach_mul_(moving, momentum)
        torch._foreach_add_(moving, moving_grads)
    return updated


def clear_grads(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Set every gradient of ``optimizers``' parameters to None, as
    ``zero_grad(set_to_none=True)`` does, without a profiler record per optimizer."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
