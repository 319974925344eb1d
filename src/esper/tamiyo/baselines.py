"""Controllers to compare the learned policy against: random legal choices, and no growth.

Both have the policy's interface (:class:`~esper.tamiyo.stateless.StatelessController`)
so the rollout loop drives them unchanged, and both decide on the device without host
reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from esper.contracts import LifecycleOp
from esper.tamiyo.action_masks import ActionMasks, select_row
from esper.tamiyo.distributions import MaskedCategorical
from esper.tamiyo.policy import ActResult, LSTMState
from esper.tamiyo.stateless import StatelessController


class RandomLegalController(StatelessController):
    """Picks uniformly among the legal choices of each head, op first (as the policy does)."""

    @torch.no_grad()
    def act(
        self,
        obs: Tensor,
        hidden: LSTMState,
        masks: ActionMasks,
        deterministic: bool = False,
        episode_starts: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> ActResult:
        def draw(mask: Tensor) -> Tensor:
            return MaskedCategorical(torch.zeros(mask.shape, device=mask.device), mask).sample(
                generator
            )

        op = draw(masks.op)
        slot = draw(select_row(masks.slot, op))
        blueprint = draw(select_row(masks.blueprint, slot))
        blend = draw(masks.blend)
        return self.chose(torch.stack((op, slot, blueprint, blend), dim=-1), hidden)


class NoGrowthController(StatelessController):
    """Always WAIT: the host trains alone. The baseline growth has to beat."""

    @torch.no_grad()
    def act(
        self,
        obs: Tensor,
        hidden: LSTMState,
        masks: ActionMasks,
        deterministic: bool = False,
        episode_starts: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> ActResult:
        actions = torch.zeros(obs.shape[0], 4, dtype=torch.long, device=obs.device)
        actions[:, 0] = int(LifecycleOp.WAIT)
        return self.chose(actions, hidden)
