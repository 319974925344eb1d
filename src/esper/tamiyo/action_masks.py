"""Which choices of each action head are legal, for a batch of envs, as device bool tensors.

The policy samples under these masks in one forward pass for all envs, and the rollout
buffer stores them so the PPO update re-evaluates each action under the mask it was
sampled with. They stay plain tensors with a shared leading batch shape ``[*B]``:
``[E]`` when acting, ``[E, T]`` in the buffer. Filling them from lifecycle state is the
mask builder's job, not this module's.

The slot and blueprint masks are indexed by the earlier choice, which is what makes the
factored heads autoregressive without a host read: the policy gathers row ``op`` of
``slot`` and row ``slot`` of ``blueprint`` on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from esper.contracts import ActionSchema


@dataclass(frozen=True)
class ActionMasks:
    """Bool masks, True = legal, sharing a leading batch shape ``[*B]``.

    Fields and shapes (``n_ops = len(LifecycleOp)``, ``S`` slots, ``B`` blueprints,
    ``NB`` blend modes):

    * ``op``        ``[*B, n_ops]``     legal ops (WAIT is always legal);
    * ``slot``      ``[*B, n_ops, S]``  for each op, the slots where it is legal;
    * ``blueprint`` ``[*B, S, B]``      for each slot, the blueprints that fit it;
    * ``blend``     ``[*B, NB]``        legal blend modes.

    A row that is all False (e.g. the slot row of WAIT) is allowed: the masked
    categorical treats it as all legal, because such a head is unused by that op and
    does not enter the log-prob. Only shapes and dtypes are checked here; checking
    values would need a host read.
    """

    op: Tensor
    slot: Tensor
    blueprint: Tensor
    blend: Tensor

    def __post_init__(self) -> None:
        for f in fields(self):
            mask = getattr(self, f.name)
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                raise TypeError(
                    f"ActionMasks.{f.name} must be a bool tensor, got "
                    f"{getattr(mask, 'dtype', type(mask))}; build it with a comparison or .bool()"
                )
        batch = self.op.shape[:-1]
        n_ops, n_slots = self.op.shape[-1], self.slot.shape[-1]
        expected = {
            "slot": (*batch, n_ops, n_slots),
            "blueprint": (*batch, n_slots, self.blueprint.shape[-1]),
            "blend": (*batch, self.blend.shape[-1]),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(
                    f"ActionMasks.{name} has shape {actual}, expected {shape} "
                    "(batch shape taken from op, S from slot's last dim)"
                )

    @property
    def batch_shape(self) -> torch.Size:
        """The leading shape shared by all masks: ``[E]`` or ``[E, T]``."""
        return self.op.shape[:-1]

    @property
    def device(self) -> torch.device:
        return self.op.device

    def map(self, fn: Callable[[Tensor], Tensor]) -> ActionMasks:
        """Apply ``fn`` to every mask; ``fn`` must act on the leading batch dims only."""
        return ActionMasks(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ActionMasks:
        return self.map(lambda m: m.to(device, non_blocking=non_blocking))

    def index_time(self, t: int) -> ActionMasks:
        """Step ``t`` of ``[E, T, ...]`` masks, as ``[E, ...]`` masks."""
        return self.map(lambda m: m[:, t])

    def index_envs(self, env_idx: Tensor) -> ActionMasks:
        """The rows of the envs in ``env_idx`` (a long tensor on the masks' device)."""
        return self.map(lambda m: m.index_select(0, env_idx))

    @staticmethod
    def stack(steps: Sequence[ActionMasks], dim: int = 1) -> ActionMasks:
        """Stack per-step ``[E, ...]`` masks into ``[E, T, ...]`` (``dim=1``)."""
        if not steps:
            raise ValueError("ActionMasks.stack needs at least one ActionMasks")
        return ActionMasks(
            **{
                f.name: torch.stack([getattr(s, f.name) for s in steps], dim=dim)
                for f in fields(ActionMasks)
            }
        )

    @staticmethod
    def all_legal(
        schema: ActionSchema,
        batch_shape: Sequence[int],
        device: torch.device | str | None = None,
    ) -> ActionMasks:
        """Masks allowing every choice: for tests, and as a template to narrow down."""
        n_ops, n_slots, n_blueprints, n_blends = (h.size for h in schema.heads)
        batch = tuple(batch_shape)

        def ones(*shape: int) -> Tensor:
            return torch.ones((*batch, *shape), dtype=torch.bool, device=device)

        return ActionMasks(
            op=ones(n_ops),
            slot=ones(n_ops, n_slots),
            blueprint=ones(n_slots, n_blueprints),
            blend=ones(n_blends),
        )


def select_row(table: Tensor, index: Tensor) -> Tensor:
    """Row ``index`` of a conditional head's table: ``[*B, R, K]`` and ``[*B]`` long ->
    ``[*B, K]``, on the device (a gather, no host read).

    The slot and blueprint heads are conditioned on the head before them: their masks and
    logits are tables with one row per choice of the parent head, and this picks the row
    the parent's choice selects.
    """
    idx = index[..., None, None].expand(*index.shape, 1, table.shape[-1])
    return table.gather(-2, idx).squeeze(-2)
