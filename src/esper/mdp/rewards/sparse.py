"""The sparse reward family: the outcome, paid once, at the episode's end.

Nothing shapes the path to the final network, so the policy cannot farm intermediate
terms; the cost is a harder credit-assignment problem for PPO. The illegal-op and
rollback penalties stay per step, because they are about the step itself: without them
the policy would get no signal to respect the action mask or avoid panics.
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


def sparse_reward(inputs: RewardInputs, config: RewardConfig) -> dict[str, np.ndarray]:
    """Terminal-only outcome plus per-step rule penalties, each ``[E]`` float32.

    * ``terminal``: on the last step, ``terminal_weight * val_acc`` minus the parameter
      rent of the final size (``param_penalty_weight * seed_params / param_budget``,
      charged once, not per step as in the shaped family); 0 on other steps;
    * ``illegal_op`` / ``rollback``: minus the matching penalty where flagged.

    A clean non-terminal step therefore pays exactly 0.
    """
    outcome = config.terminal_weight * inputs.val_acc - param_rent(inputs, config)
    components = {
        "terminal": np.where(inputs.terminal, outcome, 0.0),
        "illegal_op": flag_penalty(inputs.illegal_op, config.illegal_op_penalty),
        "rollback": flag_penalty(inputs.rollback, config.rollback_penalty),
    }
    return {name: value.astype(REWARD_DTYPE, copy=False) for name, value in components.items()}
