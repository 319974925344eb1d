"""What every controller without memory or a critic shares with the policy's interface.

The rollout loop drives any controller through ``initial_state``, ``act`` and ``value``
(``esper.mdp.rollout.Controller``). The heuristic, periodic, random and no-growth
controllers keep no recurrent state and predict no value: this base gives them a
placeholder state, zero values, and an :class:`ActResult` with zero log-probability and
entropy around their actions, so each defines only how it chooses.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from esper.tamiyo.policy import ActResult, LSTMState

#: ``(layers, hidden)`` of the placeholder recurrent state: a store that keeps the state
#: each step acted from (the rollout buffer) gets an LSTM-shaped ``(h, c)`` of this shape.
STATE_SHAPE: tuple[int, int] = (1, 1)


class StatelessController(nn.Module):
    """A controller with no memory and no critic; subclasses define ``act``."""

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState:
        """Placeholder ``(h, c)``, each ``[1, n_envs, 1]`` zeros."""
        shape = (STATE_SHAPE[0], n_envs, STATE_SHAPE[1])
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def value(self, obs: Tensor, hidden: LSTMState, episode_starts: Tensor | None = None) -> Tensor:
        """Zeros ``[E]``: no critic (a truncation bootstraps nothing)."""
        return obs.new_zeros(obs.shape[0])

    @staticmethod
    def chose(actions: Tensor, hidden: LSTMState) -> ActResult:
        """``actions [E, 4]`` as an :class:`ActResult`: zero log-prob, entropy and value,
        ``hidden`` passed through unchanged."""
        zeros = actions.new_zeros(actions.shape[0], dtype=torch.float32)
        return ActResult(actions, zeros, zeros, zeros, hidden)
