"""The rollout buffer: preallocated ``[E, T, ...]`` device tensors, one segment per env.

Each env writes at its own cursor, so a governor rollback can invalidate one env's
transitions from a given step (its cursor moves back and later steps overwrite them)
without touching any other env's data. It may keep one of them, the transition whose
epoch panicked: that one moves down to the first dropped position, so its penalty reaches
PPO. The kept transition and the env's next one are flagged ``hidden_restarts``: each
acted from its stored LSTM state, not from the previous stored step's output, and the
recurrent replay must start from it. Writes are device-to-device copies; the cursors are
Python ints, which Python already knows, so nothing is read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from esper.contracts import ActionSchema
from esper.contracts.actions import N_HEADS
from esper.simic.gae import compute_gae
from esper.simic.ppo_batch import PPOBatch
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import LSTMState

#: The per-step ``[E, T, ...]`` tensors of a transition (the masks aside), moved together.
_STEP_FIELDS = (
    "obs",
    "raw_obs",
    "actions",
    "log_probs",
    "values",
    "rewards",
    "terminated",
    "truncated",
    "valid",
    "episode_starts",
    "hidden_h",
    "hidden_c",
)


class RolloutBuffer:
    """Transitions of one rollout for ``n_envs`` envs, up to ``n_steps`` each.

    Shapes: ``obs [E, T, D]`` (normalised, as the policy saw it), ``raw_obs [E, T, D]``
    (for the normaliser's once-per-rollout update), ``actions [E, T, 4]``, ``log_probs``,
    ``values``, ``rewards [E, T]``, ``terminated``/``truncated``/``valid``/
    ``episode_starts [E, T]`` bool, ``masks`` batch ``[E, T]``, the LSTM state each step
    started from, ``hidden_h``/``hidden_c [E, T, layers, H]``, and ``hidden_restarts [E, T]``
    bool: the step acted from that stored state rather than from the previous step's.
    """

    def __init__(
        self,
        n_envs: int,
        n_steps: int,
        obs_dim: int,
        schema: ActionSchema,
        lstm_shape: tuple[int, int],
        device: torch.device | str,
    ) -> None:
        if n_envs < 1 or n_steps < 1:
            raise ValueError(f"RolloutBuffer needs n_envs, n_steps >= 1, got {n_envs}, {n_steps}")
        self.n_envs, self.n_steps, self.obs_dim = n_envs, n_steps, obs_dim
        self.device = torch.device(device)
        e, t = n_envs, n_steps

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros((e, t, *shape), dtype=dtype, device=self.device)

        self.obs = zeros(obs_dim)
        self.raw_obs = zeros(obs_dim)
        self.actions = zeros(N_HEADS, dtype=torch.long)
        self.log_probs = zeros()
        self.values = zeros()
        self.rewards = zeros()
        self.terminated = zeros(dtype=torch.bool)
        self.truncated = zeros(dtype=torch.bool)
        self.valid = zeros(dtype=torch.bool)
        self.episode_starts = zeros(dtype=torch.bool)
        layers, hidden = lstm_shape
        self.hidden_h = zeros(layers, hidden)
        self.hidden_c = zeros(layers, hidden)
        self.hidden_restarts = zeros(dtype=torch.bool)
        self.masks = ActionMasks.all_legal(schema, (e, t), self.device)
        self.pos: list[int] = [0] * n_envs
        #: Per env: its next written step is a hidden restart (it follows an invalidate).
        self._restart_next: list[bool] = [False] * n_envs
        #: Per env, the positions after 0 written so far whose step does not continue
        #: the state of the step before (an episode start, or a hidden restart after a
        #: governor rollback): host-side, for ``PPOBatch.breaks``.
        self._breaks: list[set[int]] = [set() for _ in range(n_envs)]

    # ----------------------------------------------------------------- writing
    def reset(self) -> None:
        """Start a new rollout: every cursor at 0, every step invalid."""
        self.pos = [0] * self.n_envs
        self._restart_next = [False] * self.n_envs
        self._breaks = [set() for _ in range(self.n_envs)]
        self.valid.zero_()
        self.terminated.zero_()
        self.truncated.zero_()
        self.episode_starts.zero_()
        self.hidden_restarts.zero_()
        self.rewards.zero_()

    def _where(
        self, active: Sequence[bool] | None
    ) -> tuple[Tensor | slice, Tensor | int, list[int]]:
        """Index pair selecting each active env's cursor (a plain slice when all are aligned),
        and the active env indices."""
        envs = [e for e in range(self.n_envs) if active is None or active[e]]
        full = [e for e in envs if self.pos[e] >= self.n_steps]
        if full:
            raise IndexError(f"RolloutBuffer is full for envs {full} ({self.n_steps} steps)")
        first = self.pos[0]
        if len(envs) == self.n_envs and all(p == first for p in self.pos):
            return slice(None), first, envs
        return (*self._index(envs, [self.pos[e] for e in envs]), envs)

    def _index(self, envs: Sequence[int], steps: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Long index tensors on the device, uploaded without waiting for the device."""
        both = torch.tensor([list(envs), list(steps)], dtype=torch.long)
        if self.device.type == "cuda":
            both = both.pin_memory()
        both = both.to(self.device, non_blocking=True)
        return both[0], both[1]

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
        """Write one step for every active env at its cursor; returns the positions written
        (-1 for inactive envs).

        ``hidden`` is the LSTM state the policy acted from, ``[layers, E, H]`` each. Inactive
        envs (just rolled back) write nothing and keep their cursor. An env's first step
        after :meth:`invalidate` is flagged a hidden restart.
        """
        envs, steps, rows = self._where(active)
        pick: Tensor | slice = slice(None)
        if isinstance(envs, Tensor) and len(rows) < self.n_envs:
            pick = envs

        def sel(x: Tensor, dim: int = 0) -> Tensor:
            return x if isinstance(pick, slice) else x.index_select(dim, pick)

        self.obs[envs, steps] = sel(obs)
        self.raw_obs[envs, steps] = sel(raw_obs)
        self.actions[envs, steps] = sel(actions)
        self.log_probs[envs, steps] = sel(log_probs.detach())
        self.values[envs, steps] = sel(values.detach())
        self.hidden_h[envs, steps] = sel(hidden[0], 1).transpose(0, 1)
        self.hidden_c[envs, steps] = sel(hidden[1], 1).transpose(0, 1)
        for name in ("op", "slot", "blueprint", "blend"):
            getattr(self.masks, name)[envs, steps] = sel(getattr(masks, name))
        self.valid[envs, steps] = True
        self.terminated[envs, steps] = False
        self.truncated[envs, steps] = False
        self.episode_starts[envs, steps] = episode_start
        self.hidden_restarts[envs, steps] = False
        written = [-1] * self.n_envs
        for e in rows:
            p = written[e] = self.pos[e]
            restart = self._restart_next[e]
            if restart:
                self.hidden_restarts[e, p] = True  # a device fill, no read
                self._restart_next[e] = False
            # A restart at step 0 takes the state step 0 acts from anyway: no break.
            if (episode_start or restart) and p > 0:
                self._breaks[e].add(p)
            else:
                self._breaks[e].discard(p)
            self.pos[e] += 1
        return written

    def set_rewards(self, positions: Sequence[int], rewards: Tensor, terminated: bool) -> None:
        """Rewards ``[E]`` (any device) of the transitions written at ``positions``
        (-1 = that env wrote none)."""
        rewards = rewards.to(self.device, dtype=torch.float32, non_blocking=True)
        first = positions[0]
        if first >= 0 and all(p == first for p in positions):
            self.rewards[:, first] = rewards
            self.terminated[:, first] = terminated
            return
        rows = [e for e, p in enumerate(positions) if p >= 0]
        if not rows:
            return
        envs, steps = self._index(rows, [positions[e] for e in rows])
        self.rewards[envs, steps] = rewards.index_select(0, envs)
        self.terminated[envs, steps] = terminated

    def invalidate(self, env: int, from_step: int, keep: int | None = None) -> int:
        """Drop ``env``'s transitions from ``from_step`` on; its later steps overwrite them.

        ``keep``, a position in ``[from_step, cursor)``, spares one of them (a governor
        restore keeps the transition whose epoch panicked, so its penalty is learned): it
        moves to ``from_step`` whole (observation, action, log-prob, value, reward, masks
        and the LSTM state it acted from) and is flagged a hidden restart, as is the env's
        next written step, which acts from a restored state. Returns how many transitions
        were dropped (the kept one not counted).
        """
        if not 0 <= env < self.n_envs:
            raise IndexError(f"env {env} out of range for {self.n_envs} envs")
        if not 0 <= from_step <= self.pos[env]:
            raise ValueError(
                f"env {env} can be invalidated from a step in [0, {self.pos[env]}], got {from_step}"
            )
        start = from_step
        if keep is not None:
            if not from_step <= keep < self.pos[env]:
                raise ValueError(
                    f"env {env}: the kept transition must lie in [{from_step}, {self.pos[env]}), "
                    f"got {keep}"
                )
            if keep != from_step:
                self._move(env, keep, from_step)
            self.hidden_restarts[env, from_step] = True
            start = from_step + 1
        self.valid[env, start:] = False
        self.terminated[env, start:] = False
        self.truncated[env, start:] = False
        self.hidden_restarts[env, start:] = False
        dropped = self.pos[env] - start
        self.pos[env] = start
        self._restart_next[env] = True
        breaks = self._breaks[env]
        breaks.difference_update([p for p in breaks if p >= from_step])
        if keep is not None and from_step > 0:
            breaks.add(from_step)
        return dropped

    def _move(self, env: int, src: int, dst: int) -> None:
        """Copy ``env``'s transition at ``src`` over the one at ``dst`` (on the device)."""
        for name in _STEP_FIELDS:
            tensor = getattr(self, name)
            tensor[env, dst] = tensor[env, src]
        for name in ("op", "slot", "blueprint", "blend"):
            mask = getattr(self.masks, name)
            mask[env, dst] = mask[env, src]

    def hidden_at(self, env: int, step: int) -> LSTMState:
        """The LSTM state ``env`` acted from at ``step``, ``[layers, H]`` each."""
        return self.hidden_h[env, step], self.hidden_c[env, step]

    # ---------------------------------------------------------------- reading
    def finish(self, bootstrap_values: Tensor, gamma: float, gae_lambda: float) -> PPOBatch:
        """Advantages for all envs in one GAE pass, as a :class:`PPOBatch`.

        ``bootstrap_values [E]`` is the critic's value of the observation after each env's
        last transition, from one batched pass. A last transition not marked terminated
        is a truncation and bootstraps from it.
        """
        if any(p == 0 for p in self.pos):
            empty = [i for i, p in enumerate(self.pos) if p == 0]
            raise ValueError(f"envs {empty} have no transitions in this rollout")
        envs, last = self._index(range(self.n_envs), [p - 1 for p in self.pos])
        self.truncated[envs, last] = ~self.terminated[envs, last]
        next_values = torch.zeros_like(self.values)
        next_values[:, :-1] = self.values[:, 1:]
        next_values[envs, last] = bootstrap_values.detach().to(next_values.dtype)
        done = self.terminated | self.truncated
        advantages, returns = compute_gae(
            self.rewards, self.values, next_values, self.terminated, done, gamma, gae_lambda
        )
        return PPOBatch(
            obs=self.obs,
            actions=self.actions,
            log_probs=self.log_probs,
            values=self.values,
            advantages=advantages,
            returns=returns,
            masks=self.masks,
            hidden=(self.hidden_h, self.hidden_c),
            episode_starts=self.episode_starts,
            hidden_restarts=self.hidden_restarts,
            valid=self.valid,
            breaks=tuple(
                tuple(sorted(p for p in breaks if p < pos))
                for breaks, pos in zip(self._breaks, self.pos, strict=True)
            ),
        )
