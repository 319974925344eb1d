"""The factored action space: one categorical head each for slot, blueprint, blend and op.

Plain data: tamiyo turns it into masks and heads, simic into buffer shapes. The rule
that the log-prob and entropy of an action cover only the heads its op uses is stated
once, here, by :meth:`ActionSchema.heads_for_op`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from esper.contracts.ops import BlendMode, LifecycleOp

HEAD_NAMES: tuple[str, ...] = ("op", "slot", "blueprint", "blend")
#: How many action heads (one int per head in an action row).
N_HEADS = len(HEAD_NAMES)

_HEADS_BY_OP: dict[LifecycleOp, tuple[str, ...]] = {
    LifecycleOp.WAIT: ("op",),
    LifecycleOp.GERMINATE: ("op", "slot", "blueprint", "blend"),
    LifecycleOp.ADVANCE: ("op", "slot"),
    LifecycleOp.PRUNE: ("op", "slot"),
}


@dataclass(frozen=True)
class HeadSpec:
    name: str
    size: int


@dataclass(frozen=True)
class ActionSchema:
    """The heads for one host family: its slots, the registry's blueprints, the blend modes."""

    slot_ids: tuple[str, ...]
    blueprint_names: tuple[str, ...]
    blend_modes: tuple[BlendMode, ...] = field(default=tuple(BlendMode))

    def __post_init__(self) -> None:
        for name, values in (
            ("slot_ids", self.slot_ids),
            ("blueprint_names", self.blueprint_names),
            ("blend_modes", self.blend_modes),
        ):
            if len(values) == 0:
                raise ValueError(f"ActionSchema.{name} is empty; a head needs at least one choice")
            if len(set(values)) != len(values):
                raise ValueError(f"ActionSchema.{name} has duplicates: {list(values)}")

    @property
    def heads(self) -> tuple[HeadSpec, ...]:
        sizes = {
            "op": len(LifecycleOp),
            "slot": len(self.slot_ids),
            "blueprint": len(self.blueprint_names),
            "blend": len(self.blend_modes),
        }
        return tuple(HeadSpec(name, sizes[name]) for name in HEAD_NAMES)

    @staticmethod
    def heads_for_op(op: LifecycleOp) -> tuple[str, ...]:
        """The heads whose choice matters for ``op``; only these enter log-prob and entropy."""
        return _HEADS_BY_OP[LifecycleOp(op)]

    @staticmethod
    def head_usage() -> tuple[tuple[bool, ...], ...]:
        """``[op][head]`` truth table in :data:`HEAD_NAMES` order, for building a tensor once."""
        return tuple(tuple(head in _HEADS_BY_OP[op] for head in HEAD_NAMES) for op in LifecycleOp)
