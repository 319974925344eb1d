"""The default, dense reward family: something to learn from at every step.

The change in accuracy is paid every step (it telescopes to final minus initial), the
final accuracy once more at the end, and a small parameter rent every step, so the
episode return ranks outcomes by final accuracy and then by size. Penalties teach the
mask rules and discourage panics. Seed contribution and a fossilize bonus are available
as shaping terms, off by default (``RewardConfig`` says why).
"""

from __future__ import annotations

import numpy as np

from esper.mdp.rewards.base import (
    REWARD_DTYPE,
    RewardConfig,
    RewardInputs,
    flag_penalty,
    param_rent,
)


def shaped_reward(inputs: RewardInputs, config: RewardConfig) -> dict[str, np.ndarray]:
    """Dense per-step components, each ``[E]`` float32 (sum them with ``total``).

    * ``acc_delta``: ``acc_delta_weight * (val_acc - prev_val_acc)``;
    * ``contribution``: ``contribution_weight * sum`` of the contributions of slots whose
      seed is blending or holding (other slots' values are ignored);
    * ``param_rent``: ``-param_penalty_weight * seed_params / param_budget``;
    * ``illegal_op`` / ``wasted_op`` / ``rollback``: minus the matching penalty where
      flagged;
    * ``fossilize``: ``+fossilize_bonus`` where a seed fossilized;
    * ``terminal``: ``terminal_weight * val_acc`` on the episode's last step, else 0.
    """
    counted = np.where(inputs.blending, inputs.contribution, 0.0).sum(axis=1)
    components = {
        "acc_delta": config.acc_delta_weight * (inputs.val_acc - inputs.prev_val_acc),
        "contribution": config.contribution_weight * counted,
        "param_rent": -param_rent(inputs, config),
        "illegal_op": flag_penalty(inputs.illegal_op, config.illegal_op_penalty),
        "wasted_op": flag_penalty(inputs.wasted_op, config.wasted_op_penalty),
        "fossilize": np.where(inputs.fossilized, config.fossilize_bonus, 0.0),
        "terminal": np.where(inputs.terminal, config.terminal_weight * inputs.val_acc, 0.0),
        "rollback": flag_penalty(inputs.rollback, config.rollback_penalty),
    }
    return {name: value.astype(REWARD_DTYPE, copy=False) for name, value in components.items()}
