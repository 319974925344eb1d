"""Generalised advantage estimation for every env of a rollout at once, on the device.

The rollout buffer holds ``[n_envs, T]`` tensors on the policy's device. Computing GAE
there, for all envs at once, keeps the PPO update free of host reads and of a Python
loop over envs (the earlier system looped per env, which cost a
kernel launch per env per step and a sync per bootstrap).

How it is fast. On the CPU, a C kernel built with the package (``gae_native``) walks each
env's row backwards once: one read of every input, one write of every output. Elsewhere
(CUDA, float16/bfloat16, or where the kernel was not built) tensor ops solve it with a
chunked sweep: time is cut into chunks of about ``sqrt(T)`` steps, a short reverse sweep
runs inside every chunk at once (all envs and chunks in each step), then a carry of about
``sqrt(T)`` steps goes from chunk to chunk, so a call costs about ``2 * sqrt(T)`` small
kernels instead of ``T``. The outputs double as work space and most steps run in place:
on a CPU a fresh allocation of a few megabytes costs more than the arithmetic done in it.
One tensor-ops solver, not two: a discount-matrix product (``[n_envs, T, T]``, no loop)
saves little where it is faster (few envs, short episodes) and, costing
``O(n_envs * T^2)``, loses by orders of magnitude on long ones; ``benchmarks/gae.py
--solvers`` measures both (benchmarks/README.md, GAE).

Two flags, because they mean different things:

* ``terminated``: the episode really ended at this step (there is no next state), so the
  bootstrap term ``gamma * V(s_{t+1})`` is dropped;
* ``done``: the trajectory stored in the buffer stops here (terminated *or* truncated:
  the episode-length limit, a governor rollback, the end of a segment), so the
  recursion must not carry the advantage of the next stored step (another episode)
  back across it. A truncated step still bootstraps from ``next_values``, which the
  caller fills with a critic pass on the state the episode was cut at.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from esper.contracts.checks import is_finite_real
from esper.simic import gae_native

#: Number of dimensions of every GAE input: ``[n_envs, T]``.
_INPUT_NDIM = 2
#: ``backend`` values of ``compute_gae``: pick for me, tensor ops only, the C kernel only.
BACKENDS = ("auto", "torch", "native")


def _check_rate(name: str, value: float) -> None:
    """Refuse a discount/trace parameter that is not a finite number in ``[0, 1]``."""
    if not is_finite_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"compute_gae: {name} must be a number in [0, 1], got {value!r}")


def _check_inputs(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
) -> None:
    """Host-side checks of shape, dtype and device only: no tensor value is read."""
    if not isinstance(rewards, Tensor) or rewards.ndim != _INPUT_NDIM:
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"compute_gae: rewards must be a [n_envs, T] tensor, got {got}")
    if not rewards.is_floating_point():
        raise ValueError(f"compute_gae: rewards must be a floating tensor, got {rewards.dtype}")
    shape = tuple(rewards.shape)
    named = {
        "values": values,
        "next_values": next_values,
        "terminated": terminated,
        "done": done,
    }
    for name, tensor in named.items():
        if not isinstance(tensor, Tensor):
            raise ValueError(
                f"compute_gae: {name} must be a tensor of shape {shape} [n_envs, T], "
                f"got {type(tensor).__name__}"
            )
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"compute_gae: {name} must have the shape of rewards, {shape} [n_envs, T], "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.device != rewards.device:
            raise ValueError(
                f"compute_gae: {name} is on {tensor.device} but rewards on {rewards.device}; "
                "move every input to one device"
            )
    for name in ("values", "next_values"):
        if named[name].dtype != rewards.dtype:
            raise ValueError(
                f"compute_gae: {name} must have the dtype of rewards ({rewards.dtype}), "
                f"got {named[name].dtype}"
            )
    for name in ("terminated", "done"):
        if named[name].dtype != torch.bool:
            raise ValueError(f"compute_gae: {name} must be a bool tensor, got {named[name].dtype}")


def compute_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Advantages and value targets (returns) for ``n_envs`` trajectories of length ``T``.

    For every env ``e`` and step ``t``::

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
        A_t     = delta_t + gamma * gae_lambda * (1 - done_t) * A_{t+1},   A_T = 0
        R_t     = A_t + V(s_t)

    All envs are solved together and nothing is read on the host, so it runs on CUDA
    without a sync. The results are targets, not part of any graph: they are computed
    without autograd.

    Args:
        rewards: ``[n_envs, T]`` floating, the reward received after each step's action.
        values: ``[n_envs, T]`` same dtype, the critic's ``V(s_t)`` at each step.
        next_values: ``[n_envs, T]`` same dtype, ``V(s_{t+1})`` for each step. Inside an
            episode this is ``values[:, t + 1]``; at a truncated step (and at the last
            stored step) it is a bootstrap critic pass on the state the trajectory stops
            at. Multiplied by zero where ``terminated``, so it must be finite there too.
        terminated: ``[n_envs, T]`` bool, the episode ended for real at this step: no
            bootstrap.
        done: ``[n_envs, T]`` bool, the stored trajectory stops at this step (terminated
            or truncated): the recursion does not carry ``A_{t+1}`` back across it. A
            terminated step counts as done even where ``done`` omits it, since nothing
            follows a real end.
        gamma: discount in ``[0, 1]``.
        gae_lambda: trace decay in ``[0, 1]``; 0 gives one-step TD errors, 1 gives Monte
            Carlo returns minus values (bootstrapped at truncations).
        backend: ``"auto"`` runs the C kernel where ``gae_native.supports`` the inputs
            (CPU, float32/float64, kernel built) and tensor ops elsewhere; ``"torch"``
            forces tensor ops; ``"native"`` forces the kernel and fails where it can't run.
            All give the same results within float rounding.

    Returns:
        ``(advantages, returns)``, both new ``[n_envs, T]`` contiguous tensors with the
        dtype and device of ``rewards``.

    Raises:
        ValueError: an input has the wrong shape, dtype or device, or ``gamma`` /
            ``gae_lambda`` lies outside ``[0, 1]``, or ``backend`` is not in ``BACKENDS``.
        RuntimeError: ``backend="native"`` where the kernel can't run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"compute_gae: backend must be one of {BACKENDS}, got {backend!r}")
    _check_inputs(rewards, values, next_values, terminated, done)
    _check_rate("gamma", gamma)
    _check_rate("gae_lambda", gae_lambda)
    # Targets, not part of any graph. Detaching only what needs it is cheaper than a
    # no_grad context, which costs more than the whole solve at small sizes.
    rewards, values, next_values = (
        x.detach() if x.requires_grad else x for x in (rewards, values, next_values)
    )
    if backend == "native" or (backend == "auto" and gae_native.supports(rewards)):
        return gae_native.gae_native(
            rewards, values, next_values, terminated, done, gamma, gae_lambda
        )
    return _gae_by_chunks(rewards, values, next_values, terminated, done, gamma, gae_lambda)


def _gae_by_chunks(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Chunked sweep of ``[n_envs, T]``: about ``2 * sqrt(T)`` steps of small kernels.

    Time is cut into ``n_chunks`` chunks of ``chunk`` steps (the last ``T % chunk`` steps
    form a short tail swept first). Inside a chunk, with ``A`` after it taken as 0, the
    reverse sweep runs for every env and chunk at once on a ``[E, chunk, n_chunks]``
    copy, whose rows for one in-chunk step are contiguous; the same sweep turns each
    step's decay into ``P_t``, the product of the decays from ``t`` to the chunk's end.
    Then ``x_n``, the true ``A`` at the first step after chunk ``n``, is carried back
    over the chunks, and ``A_t = local_t + P_t * x_n`` finishes every step at once.
    """
    n_envs, n_steps = rewards.shape
    chunk = max(1, math.isqrt(n_steps))
    n_chunks = n_steps // chunk
    body = n_chunks * chunk  # steps covered by whole chunks; the rest is the tail
    decay = gamma * gae_lambda

    # The two outputs double as work space: returns first holds the bootstrap mask, then
    # the chunked copy of the deltas. Bool masks are read as uint8, whose conversion to
    # floating point is vectorised (bool's is not, and costs several times as much).
    returns = rewards.new_empty(n_envs, n_steps)
    returns.copy_(torch.logical_not(terminated).view(torch.uint8))
    advantages = rewards.new_empty(n_envs, n_steps)
    torch.addcmul(rewards, returns, next_values, value=gamma, out=advantages).sub_(values)
    carries = torch.logical_or(done, terminated).logical_not_().view(torch.uint8)

    if body < n_steps:  # the tail: fewer than `chunk` steps, swept one by one
        tail_decays = carries[:, body:].to(rewards.dtype).mul_(decay).unbind(1)
        tail = advantages[:, body:].unbind(1)
        for t in range(len(tail) - 2, -1, -1):
            tail[t].addcmul_(tail_decays[t], tail[t + 1])

    # [E, chunk, n_chunks] copies: row i holds in-chunk step i of every chunk.
    chunked_deltas = advantages[:, :body].unflatten(1, (n_chunks, chunk))
    local = returns.view(-1)[: n_envs * body].view(n_envs, chunk, n_chunks)
    local.transpose(1, 2).copy_(chunked_deltas)
    chunked_carries = carries.new_empty(n_envs, chunk, n_chunks)
    chunked_carries.transpose(1, 2).copy_(carries[:, :body].unflatten(1, (n_chunks, chunk)))
    to_chunk_end = rewards.new_empty(n_envs, chunk, n_chunks).copy_(chunked_carries)
    to_chunk_end.mul_(decay)
    local_steps, decay_steps = local.unbind(1), to_chunk_end.unbind(1)
    for i in range(chunk - 2, -1, -1):
        local_steps[i].addcmul_(decay_steps[i], local_steps[i + 1])
        decay_steps[i].mul_(decay_steps[i + 1])

    # Carry across chunks on contiguous rows: after[n] is A at the first step after chunk n.
    chunk_starts = local_steps[0].T.contiguous().unbind(0)
    chunk_decays = decay_steps[0].T.contiguous().unbind(0)
    after = rewards.new_empty(n_chunks, n_envs)
    after_rows = after.unbind(0)
    if body < n_steps:
        after_rows[-1].copy_(advantages[:, body])
    else:
        after_rows[-1].zero_()
    for n in range(n_chunks - 2, -1, -1):
        torch.addcmul(
            chunk_starts[n + 1], chunk_decays[n + 1], after_rows[n + 1], out=after_rows[n]
        )

    torch.addcmul(local, to_chunk_end, after.T.unsqueeze(1), out=chunked_deltas.transpose(1, 2))
    torch.add(advantages, values, out=returns)
    return advantages, returns
