"""Advantages relative to the other envs of a rollout that started from the same host.

When every env of a rollout starts from the same host weights and sees the same batches
(``EnvConfig.shared_host_init``; the batches are shared already), two envs whose policy
acted alike train alike. What the critic cannot predict (how well this host happens to
train) is then common to all envs at a step, while what the policy did is not. Taking
each env's advantage minus the mean of the *other* envs' at the same step cancels the
common part and keeps the part the actions caused: a leave-one-out baseline, as in
RLOO, applied to GAE advantages. Leaving the env itself out keeps the baseline
independent of its own action.
"""

from __future__ import annotations

import torch
from torch import Tensor


def leave_one_out(advantages: Tensor, valid: Tensor) -> Tensor:
    """``advantages [E, T]`` minus, per step, the mean over the other valid envs.

    Args:
        advantages: ``[E, T]`` float, GAE advantages of each env's transitions.
        valid: ``[E, T]`` bool, transitions that exist (a rollback can leave gaps).

    Returns:
        ``[E, T]``: ``a[e, t] - mean(a[e', t] for e' != e with valid[e', t])``; where no
        other env is valid at ``t`` the advantage is returned unchanged, and invalid
        entries are returned unchanged (PPO masks them). Pure tensor ops, no host read.
    """
    if advantages.shape != valid.shape or advantages.dim() != 2:
        raise ValueError(
            f"leave_one_out: advantages {tuple(advantages.shape)} and valid "
            f"{tuple(valid.shape)} must both be [E, T]"
        )
    weights = valid.to(advantages.dtype)
    masked = torch.where(valid, advantages, 0.0)
    others_sum = masked.sum(dim=0, keepdim=True) - masked
    others_n = weights.sum(dim=0, keepdim=True) - weights
    baseline = torch.where(others_n > 0, others_sum / others_n.clamp(min=1.0), 0.0)
    return torch.where(valid, advantages - baseline, advantages)
