"""A bandit in the policy's own action space, for the PPO learning test (not a test module).

Every step shows the same observation and the same masks. Exactly one full action pays
1: GERMINATE on slot ``s1`` with blueprint ``b2`` and the COSINE blend; everything else
pays 0. The masks rule some choices out (ADVANCE everywhere, GERMINATE on ``s2``,
blueprint ``b1`` on ``s1``, ...), so a policy that learns must both respect them and
learn all four heads together: a uniform policy over the legal choices hits the prize
once in 48 tries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from esper.contracts import ActionSchema, BlendMode, LifecycleOp
from esper.tamiyo.action_masks import ActionMasks

SCHEMA = ActionSchema(slot_ids=("s0", "s1", "s2"), blueprint_names=("b0", "b1", "b2", "b3"))
OBS_DIM = 4
BEST_ACTION: tuple[int, int, int, int] = (LifecycleOp.GERMINATE, 1, 2, BlendMode.COSINE)
PRIZE = 1.0


class BanditEnv:
    """``n_envs`` copies of the bandit; tensors live on ``device``."""

    def __init__(self, n_envs: int, device: torch.device | str = "cpu") -> None:
        self.n_envs = n_envs
        self.device = torch.device(device)
        self._obs = torch.linspace(-1.0, 1.0, OBS_DIM, device=self.device).expand(n_envs, -1)
        self._best = torch.tensor(BEST_ACTION, device=self.device)
        self._masks = self._build_masks()

    def _build_masks(self) -> ActionMasks:
        masks = ActionMasks.all_legal(SCHEMA, (self.n_envs,), self.device)
        masks.op[:, LifecycleOp.ADVANCE] = False
        masks.slot[:, LifecycleOp.WAIT] = False
        masks.slot[:, LifecycleOp.ADVANCE] = False
        masks.slot[:, LifecycleOp.GERMINATE, 2] = False  # s2 takes no new seed
        masks.slot[:, LifecycleOp.PRUNE, :2] = False  # only s2 holds a seed to prune
        masks.blueprint[:, 1, 1] = False  # b1 does not fit s1
        masks.blueprint[:, 1, 3] = False  # nor does b3
        return masks

    def observe(self) -> Tensor:
        """``[E, OBS_DIM]``, the same every step."""
        return self._obs.clone()

    def masks(self) -> ActionMasks:
        return self._masks

    def step(self, actions: Tensor) -> Tensor:
        """Reward ``[E]``: :data:`PRIZE` for :data:`BEST_ACTION`, else 0."""
        return (actions == self._best).all(dim=-1).to(torch.float32) * PRIZE
