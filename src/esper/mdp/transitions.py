"""Where the rollout loop keeps each env's transitions, and a keeper for runs that learn none.

The loop writes one transition per acting env per step, prices it a step later and, on a
governor restore, drops one env's transitions since a snapshot. It needs only the
operations of :class:`TransitionStore`; what a store keeps is its own business: the PPO
buffer (``esper.simic.buffer.RolloutBuffer``) keeps every tensor for the update, while
evaluation, which learns nothing, keeps only where each env's next transition would go
(:class:`Cursors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import LSTMState


class TransitionStore(Protocol):
    """One rollout's transitions, one segment per env, each with its own cursor."""

    n_envs: int
    n_steps: int
    #: Per env, the position its next transition is written at.
    pos: list[int]

    def reset(self) -> None:
        """Start a new rollout: every cursor at 0."""
        ...

    def add(
        self,
        obs: Tensor,
        raw_obs: Tensor,
        actions: Tensor,
        log_probs: Tensor,
        values: Tensor,
        masks: ActionMasks,
        hidden: LSTMState,
        episode_start: bool,
        active: Sequence[bool] | None = None,
    ) -> list[int]:
        """Write one step for every active env; the positions written (-1: inactive)."""
        ...

    def set_rewards(self, positions: Sequence[int], rewards: Tensor, terminated: bool) -> None:
        """Rewards ``[E]`` of the transitions at ``positions`` (-1: that env wrote none)."""
        ...

    def invalidate(self, env: int, from_step: int, keep: int | None = None) -> int:
        """Drop ``env``'s transitions from ``from_step`` on, sparing ``keep`` (moved down to
        ``from_step``); returns how many were dropped."""
        ...


class Cursors:
    """A :class:`TransitionStore` that keeps no transitions, only each env's cursor.

    For rollouts nothing learns from (evaluation): the loop's bookkeeping (positions of
    pending transitions, a restore's dropped count) stays exact, with no device memory.
    """

    def __init__(self, n_envs: int, n_steps: int) -> None:
        if n_envs < 1 or n_steps < 1:
            raise ValueError(f"Cursors needs n_envs, n_steps >= 1, got {n_envs}, {n_steps}")
        self.n_envs, self.n_steps = n_envs, n_steps
        self.pos: list[int] = [0] * n_envs

    def reset(self) -> None:
        self.pos = [0] * self.n_envs

    def add(
        self,
        obs: Tensor,
        raw_obs: Tensor,
        actions: Tensor,
        log_probs: Tensor,
        values: Tensor,
        masks: ActionMasks,
        hidden: LSTMState,
        episode_start: bool,
        active: Sequence[bool] | None = None,
    ) -> list[int]:
        written = [-1] * self.n_envs
        for e in range(self.n_envs):
            if active is not None and not active[e]:
                continue
            if self.pos[e] >= self.n_steps:
                raise IndexError(f"env {e} already holds its {self.n_steps} steps")
            written[e] = self.pos[e]
            self.pos[e] += 1
        return written

    def set_rewards(self, positions: Sequence[int], rewards: Tensor, terminated: bool) -> None:
        return None  # nothing is kept to price

    def invalidate(self, env: int, from_step: int, keep: int | None = None) -> int:
        if not 0 <= env < self.n_envs:
            raise IndexError(f"env {env} out of range for {self.n_envs} envs")
        if not 0 <= from_step <= self.pos[env]:
            raise ValueError(
                f"env {env} can be invalidated from a step in [0, {self.pos[env]}], got {from_step}"
            )
        if keep is not None and not from_step <= keep < self.pos[env]:
            raise ValueError(
                f"env {env}: the kept transition must lie in [{from_step}, {self.pos[env]}), "
                f"got {keep}"
            )
        start = from_step if keep is None else from_step + 1
        dropped = self.pos[env] - start
        self.pos[env] = start
        return dropped
