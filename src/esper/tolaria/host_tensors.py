"""A host's tensors read once: by name, and each slot's seed and gate tensors.

Why: each ``parameters()`` or ``buffers()`` call walks a module tree, and the stacked
engine's grouping and a group's set-up (``esper.tolaria.stack_grouping``,
``esper.tolaria.stacked``) asked each seed and gate for its tensors several times an epoch:
about 2 700 walks an epoch at 16 envs on the side-by-side work, most of the CPU time a
group's set-up took. Read here, a host costs two walks and four a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from esper.kasmina.hosts.base import HostModel
from esper.kasmina.slot import SeedSlot

#: A host's parameters and buffers, each by name.
Named = tuple[dict[str, Tensor], dict[str, Tensor]]


def named_tensors(model: nn.Module | None) -> Named:
    if model is None:
        return {}, {}
    return dict(model.named_parameters()), dict(model.named_buffers())


@dataclass(frozen=True)
class SlotTensors:
    """One slot's seed and gate tensors, each by its name in that module (none where the
    slot has no seed or no gate)."""

    seed: Named
    gate: Named

    @classmethod
    def of(cls, slot: SeedSlot) -> SlotTensors:
        return cls(named_tensors(slot.seed), named_tensors(slot.gate))

    def seed_parameters(self) -> list[Tensor]:
        """The seed's parameters, then its gate's (``SeedSlot.seed_parameters``' order)."""
        return [*self.seed[0].values(), *self.gate[0].values()]

    def ids(self, *parts: Named) -> set[int]:
        """The ids of every parameter and buffer of ``parts`` (this slot's seed, gate)."""
        return {id(t) for part in parts for tensors in part for t in tensors.values()}


@dataclass(frozen=True)
class HostTensors:
    """A host's parameters and buffers by name, and each slot's seed and gate tensors."""

    named: Named
    #: By slot id.
    slots: dict[str, SlotTensors]

    @classmethod
    def of(cls, model: HostModel) -> HostTensors:
        slots = {slot.slot_id: SlotTensors.of(slot) for slot in model.iter_slots()}
        return cls(named_tensors(model), slots)
