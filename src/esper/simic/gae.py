"""Generalised advantage estimation for every env of a rollout at once, on the device.

The rollout buffer holds ``[n_envs, T]`` tensors on the policy's device. Computing GAE
there, for all envs in one reverse sweep over time, keeps the PPO update free of host
reads and of a Python loop over envs (the earlier system looped per env, which cost a
kernel launch per env per step and a sync per bootstrap).

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
import numbers

import torch
from torch import Tensor

#: Number of dimensions of every GAE input: ``[n_envs, T]``.
_INPUT_NDIM = 2


def _check_rate(name: str, value: float) -> None:
    """Refuse a discount/trace parameter that is not a finite number in ``[0, 1]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
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


@torch.no_grad()
def compute_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Advantages and value targets (returns) for ``n_envs`` trajectories of length ``T``.

    For every env ``e`` and step ``t``::

        delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
        A_t     = delta_t + gamma * gae_lambda * (1 - done_t) * A_{t+1},   A_T = 0
        R_t     = A_t + V(s_t)

    All envs advance together: one reverse sweep over ``T`` with ``[n_envs]`` vector ops,
    no loop over envs and no host read, so it runs on CUDA without a sync. The results
    are targets, not part of any graph: they are computed without autograd.

    Args:
        rewards: ``[n_envs, T]`` floating, the reward received after each step's action.
        values: ``[n_envs, T]`` same dtype, the critic's ``V(s_t)`` at each step.
        next_values: ``[n_envs, T]`` same dtype, ``V(s_{t+1})`` for each step. Inside an
            episode this is ``values[:, t + 1]``; at a truncated step (and at the last
            stored step) it is a bootstrap critic pass on the state the trajectory stops
            at. Ignored where ``terminated``.
        terminated: ``[n_envs, T]`` bool, the episode ended for real at this step: no
            bootstrap.
        done: ``[n_envs, T]`` bool, the stored trajectory stops at this step (terminated
            or truncated): the recursion does not carry ``A_{t+1}`` back across it. A
            terminated step counts as done even where ``done`` omits it, since nothing
            follows a real end.
        gamma: discount in ``[0, 1]``.
        gae_lambda: trace decay in ``[0, 1]``; 0 gives one-step TD errors, 1 gives Monte
            Carlo returns minus values (bootstrapped at truncations).

    Returns:
        ``(advantages, returns)``, both ``[n_envs, T]`` contiguous, with the dtype and
        device of ``rewards``.

    Raises:
        ValueError: an input has the wrong shape, dtype or device, or ``gamma`` /
            ``gae_lambda`` lies outside ``[0, 1]``.
    """
    _check_inputs(rewards, values, next_values, terminated, done)
    _check_rate("gamma", gamma)
    _check_rate("gae_lambda", gae_lambda)

    not_terminated = (~terminated).to(rewards.dtype)
    carries = (~(done | terminated)).to(rewards.dtype)
    # Everything that does not depend on the recursion, for all steps at once: [E, T].
    deltas = rewards + gamma * next_values * not_terminated - values
    decays = (gamma * gae_lambda) * carries

    # Time-major copies so each step's [E] row is contiguous for the sweep: [T, E].
    deltas_tm = deltas.T.contiguous()
    decays_tm = decays.T.contiguous()
    advantages_tm = torch.empty_like(deltas_tm)
    n_steps = deltas_tm.shape[0]
    following = deltas_tm.new_zeros(deltas_tm.shape[1])  # A_T = 0: nothing after the rollout
    for t in range(n_steps - 1, -1, -1):
        # A_t = delta_t + decay_t * A_{t+1}, written in place into row t.
        torch.addcmul(deltas_tm[t], decays_tm[t], following, out=advantages_tm[t])
        following = advantages_tm[t]

    advantages = advantages_tm.T.contiguous()
    returns = advantages + values
    return advantages, returns
