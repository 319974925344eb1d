"""Controllers to compare the learned policy against: random legal choices, and no growth.

Both have the policy's interface (``initial_state``, ``act``, ``value``) so the rollout
loop drives them unchanged, and both decide on the device without host reads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from esper.contracts import LifecycleOp
from esper.tamiyo.action_masks import ActionMasks, select_row
from esper.tamiyo.distributions import MaskedCategorical
from esper.tamiyo.policy import ActResult, LSTMState

#: Baselines keep no memory; the rollout buffer still stores a state of this shape.
STATE_SHAPE = (1, 1)


class _Stateless(nn.Module):
    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState:
        shape = (STATE_SHAPE[0], n_envs, STATE_SHAPE[1])
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def value(self, obs: Tensor, hidden: LSTMState, episode_starts: Tensor | None = None) -> Tensor:
        return obs.new_zeros(obs.shape[0])

    def _result(self, actions: Tensor, hidden: LSTMState) -> ActResult:
        zeros = actions.new_zeros(actions.shape[0], dtype=torch.float32)
        return ActResult(actions, zeros, zeros, zeros, hidden)


class RandomLegalController(_Stateless):
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
        return self._result(torch.stack((op, slot, blueprint, blend), dim=-1), hidden)


class NoGrowthController(_Stateless):
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
        return self._result(actions, hidden)
