"""PPOBatch: one rollout as the PPO update reads it, env-major, with what the replay needs.

A recurrent replay must reproduce the LSTM state the policy acted from at every step.
Mostly that is the previous step's output (or zeros at an episode start), but a governor
restore breaks the chain for one env: the transition whose epoch panicked is kept with the
state it acted from, and the env's next transition acts from its snapshot's state. The
batch therefore carries every step's stored state (``hidden``) and a flag per step
(``hidden_restarts``) saying "take the stored state here"; :meth:`PolicyNetwork.evaluate
<esper.tamiyo.policy.PolicyNetwork.evaluate>` applies it with a ``torch.where`` per step,
so the replay makes no host read. Where the flags are, and the episode starts after step
0, the buffer knows host-side (``breaks``): the replay then runs the stretches between
them in one fused LSTM call (``esper.tamiyo.replay_segments``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import LSTMState

#: Fields of shape ``[E, T]``.
_ENV_TIME_FIELDS = (
    "log_probs",
    "values",
    "advantages",
    "returns",
    "episode_starts",
    "hidden_restarts",
    "valid",
)
#: The ``[E, T]`` fields that are flags.
_BOOL_FIELDS = ("episode_starts", "hidden_restarts", "valid")
#: Dimensions of a stored LSTM state tensor: ``[E, T, layers, H]``.
_HIDDEN_NDIM = 4


@dataclass(frozen=True)
class PPOBatch:
    """One rollout, env-major, all on the policy's device.

    ``obs [E, T, D]``; ``actions [E, T, 4]`` long; ``log_probs``, ``values``,
    ``advantages``, ``returns`` ``[E, T]`` float; ``masks`` with batch shape ``[E, T]``;
    ``hidden`` the LSTM state each step acted from, ``(h, c)`` each ``[E, T, layers, H]``
    (``hidden0`` is its step 0); ``episode_starts [E, T]`` bool (state is zeroed before
    these steps); ``hidden_restarts [E, T]`` bool (the step acted from its stored
    ``hidden``, not from the previous step's output: a governor restore); ``valid [E, T]``
    bool (False = dropped, contributes nothing).
    """

    obs: Tensor
    actions: Tensor
    log_probs: Tensor
    values: Tensor
    advantages: Tensor
    returns: Tensor
    masks: ActionMasks
    hidden: LSTMState
    episode_starts: Tensor
    hidden_restarts: Tensor
    valid: Tensor
    #: Host-side, per env: the valid steps after step 0 whose state does not continue
    #: from the step before (``episode_starts`` or ``hidden_restarts`` there), ascending,
    #: so the replay may run the LSTM over the stretches between them in one call
    #: (``PolicyNetwork.evaluate``'s ``breaks``); steps past an env's last valid one
    #: carry nothing the update reads. None claims nothing: the replay steps through.
    breaks: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        env_time = tuple(self.obs.shape[:2])
        for name in _ENV_TIME_FIELDS:
            shape = tuple(getattr(self, name).shape)
            if shape != env_time:
                raise ValueError(f"PPOBatch.{name} has shape {shape}, expected [E, T] = {env_time}")
        if tuple(self.actions.shape[:2]) != env_time or self.actions.dim() != 3:
            raise ValueError(
                f"PPOBatch.actions has shape {tuple(self.actions.shape)}, expected [E, T, 4]"
            )
        if tuple(self.masks.batch_shape) != env_time:
            raise ValueError(
                f"PPOBatch.masks has batch shape {tuple(self.masks.batch_shape)}, expected {env_time}"
            )
        for name in _BOOL_FIELDS:
            if getattr(self, name).dtype != torch.bool:
                raise TypeError(f"PPOBatch.{name} must be a bool tensor")
        for state in self.hidden:
            if state.dim() != _HIDDEN_NDIM or tuple(state.shape[:2]) != env_time:
                raise ValueError(
                    f"PPOBatch.hidden tensors must be [E, T] = {env_time} + [layers, H], "
                    f"got {tuple(state.shape)}"
                )
        if self.breaks is not None and len(self.breaks) != env_time[0]:
            raise ValueError(
                f"PPOBatch.breaks lists {len(self.breaks)} envs, expected E = {env_time[0]}"
            )

    @property
    def unbroken(self) -> bool:
        """No env's state is reset after step 0 or restored at all: the replay runs whole
        sequences in one LSTM call."""
        return self.breaks is not None and not any(self.breaks)

    @property
    def n_envs(self) -> int:
        return self.obs.shape[0]

    @property
    def hidden0(self) -> LSTMState:
        """The state step 0 acted from, ``(h, c)`` each ``[layers, E, H]``."""
        h, c = self.hidden
        return (h[:, 0].transpose(0, 1).contiguous(), c[:, 0].transpose(0, 1).contiguous())

    def to(self, device: torch.device) -> PPOBatch:
        """The batch on ``device`` (itself where it already is there)."""
        if self.obs.device == device:
            return self
        return self._map(lambda t: t.to(device), lambda: range(self.n_envs))

    def split_envs(self, parts: int) -> list[PPOBatch]:
        """``parts`` sub-batches of consecutive envs, sizes as ``Tensor.tensor_split``
        gives them, every field a view of this batch's (no copy)."""
        return [
            self._map(lambda t, a=a, b=b: t[a:b], lambda a=a, b=b: range(a, b))
            for a, b in split_bounds(self.n_envs, parts)
        ]

    def select_envs(self, order: Tensor) -> PPOBatch:
        """The sub-batch of envs ``order`` (long, on the CPU), sequences whole, with their
        stored states and restart flags. Where some env's chain of states breaks, its
        ``breaks`` are picked host-side: ``order`` is read, a CPU tensor (no device wait)."""
        env_idx = self._env_index(order)
        return self._map(lambda t: t.index_select(0, env_idx), order.tolist)

    def breaks_of(self, order: Tensor) -> tuple[tuple[int, ...], ...] | None:
        """The ``breaks`` of :meth:`select_envs` of ``order`` (read only where some env's
        chain breaks: a CPU tensor, no device wait)."""
        return self._breaks_of(order.tolist, order.shape[0])

    def select_envs_into(self, order: Tensor, out: Sequence[Tensor]) -> None:
        """:meth:`select_envs` of ``order`` written into ``out`` (as :meth:`tensors`
        orders them, each of the selection's shape): the same gathers, into memory that
        stays put."""
        env_idx = self._env_index(order)
        for t, target in zip(self.tensors(), out, strict=True):
            torch.index_select(t, 0, env_idx, out=target)

    def _env_index(self, order: Tensor) -> Tensor:
        """``order`` (on the CPU: its breaks are read host-side) on the batch's device."""
        if order.device.type != "cpu":
            raise ValueError("PPOBatch.select_envs takes the envs' order on the CPU")
        return order.to(self.obs.device, non_blocking=True)

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the batch, masks and stored states included, in the order
        :meth:`from_tensors` takes them: what a recorded update copies into the tensors
        its graph reads (``esper.simic.ppo_graph``)."""
        return (
            *(getattr(self, name) for name in _TENSOR_FIELDS),
            *(getattr(self.masks, f.name) for f in fields(ActionMasks)),
            *self.hidden,
        )

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[Tensor], breaks: tuple[tuple[int, ...], ...] | None = None
    ) -> PPOBatch:
        """The batch of ``tensors`` (as :meth:`tensors` orders them) and ``breaks``."""
        n, m = len(_TENSOR_FIELDS), len(fields(ActionMasks))
        if len(tensors) != n + m + 2:
            raise ValueError(f"PPOBatch.from_tensors takes {n + m + 2} tensors, got {len(tensors)}")
        return cls(
            **dict(zip(_TENSOR_FIELDS, tensors[:n], strict=True)),
            masks=ActionMasks(*tensors[n : n + m]),
            hidden=(tensors[n + m], tensors[n + m + 1]),
            breaks=breaks,
        )

    def _map(self, fn: Callable[[Tensor], Tensor], envs: Callable[[], Sequence[int]]) -> PPOBatch:
        """``fn`` applied to every tensor (masks and stored states included), which then
        holds ``envs()`` of this batch in that order (asked only where an env's chain of
        states breaks); ``fn`` must keep the env dim first."""
        per_field = {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if f.name not in ("masks", "hidden", "breaks")
        }
        return PPOBatch(
            **per_field,
            masks=self.masks.map(fn),
            hidden=(fn(self.hidden[0]), fn(self.hidden[1])),
            breaks=self._breaks_of(envs, per_field["obs"].shape[0]),
        )

    def _breaks_of(
        self, envs: Callable[[], Sequence[int]], n_envs: int
    ) -> tuple[tuple[int, ...], ...] | None:
        if self.breaks is None:
            return None
        if not any(self.breaks):  # every subset is unbroken: no need to know which envs
            return ((),) * n_envs
        return tuple(self.breaks[e] for e in envs())


def split_bounds(n_envs: int, parts: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each of ``parts`` runs of consecutive envs of ``n_envs``, sizes
    as ``Tensor.tensor_split`` gives them: :meth:`PPOBatch.split_envs`' minibatches."""
    size, larger = divmod(n_envs, parts)
    ends = [k * size + min(k, larger) for k in range(parts + 1)]
    return list(itertools.pairwise(ends))


#: The fields that are one tensor each (``masks`` and ``hidden`` hold several, ``breaks``
#: none), in :meth:`PPOBatch.tensors`' order.
_TENSOR_FIELDS = tuple(
    f.name for f in fields(PPOBatch) if f.name not in ("masks", "hidden", "breaks")
)
