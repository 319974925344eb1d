"""Advantages relative to the other envs of a rollout that started from the same host.

When every env of a rollout starts from the same host weights and sees the same batches
(``esper.mdp.pairing``, which ``PPOConfig.paired_envs`` sets; the batches are shared
already), two envs whose policy acted alike train alike. What the critic cannot predict (how well this host happens to
train) is then common to all envs at a step, while what the policy did is not. Taking
each env's advantage minus the mean of the *other* envs' at the same step cancels the
common part and keeps the part the actions caused: a leave-one-out baseline, as in
RLOO, applied by default to the returns themselves (``PPOConfig.critic_baseline``
false) or to GAE advantages (true: the critic's values subtracted first). Leaving the
env itself out keeps the baseline independent of its own action.

A rank's envs may form several such groups (``PPOConfig.pair_size``): each group starts
from its own host, and an env is compared only with the others of its group. More groups
give PPO more transitions per update while each host still trains on the same share of
the data.
"""

from __future__ import annotations

import torch
from torch import Tensor


def leave_one_out(advantages: Tensor, valid: Tensor, group: int | None = None) -> Tensor:
    """``advantages [E, T]`` minus, per step, the mean over the other valid envs of the group.

    Args:
        advantages: ``[E, T]`` float, GAE advantages of each env's transitions.
        valid: ``[E, T]`` bool, transitions that exist (a rollback can leave gaps).
        group: envs per group, consecutive envs ``[g * group, (g + 1) * group)`` forming
            group ``g``; must divide ``E``. None: all ``E`` envs are one group.

    Returns:
        ``[E, T]``: ``a[e, t] - mean(a[e', t] for e' != e in e's group with valid[e', t])``;
        where no other env of the group is valid at ``t`` the advantage is returned
        unchanged, and invalid entries are returned unchanged (PPO masks them). Pure
        tensor ops, no host read.
    """
    if advantages.shape != valid.shape or advantages.dim() != 2:
        raise ValueError(
            f"leave_one_out: advantages {tuple(advantages.shape)} and valid "
            f"{tuple(valid.shape)} must both be [E, T]"
        )
    n_envs, steps = advantages.shape
    group = n_envs if group is None else group
    if group < 1 or n_envs % group:
        raise ValueError(f"leave_one_out: group={group} must divide the {n_envs} envs")
    grouped = advantages.reshape(n_envs // group, group, steps)
    ok = valid.reshape(n_envs // group, group, steps)
    weights = ok.to(advantages.dtype)
    masked = torch.where(ok, grouped, 0.0)
    others_sum = masked.sum(dim=1, keepdim=True) - masked
    others_n = weights.sum(dim=1, keepdim=True) - weights
    baseline = torch.where(others_n > 0, others_sum / others_n.clamp(min=1.0), 0.0)
    return torch.where(ok, grouped - baseline, grouped).reshape(n_envs, steps)
