"""What a blueprint is: a recipe for a seed module, with the shapes it fits and its size.

A blueprint knows its parameter count for a slot before anything is built, so the
action mask can rule out blueprints that would break the parameter budget without
instantiating them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

#: Host kinds a blueprint may declare.
HOST_KINDS: frozenset[str] = frozenset({"cnn", "transformer"})


@dataclass(frozen=True)
class SlotShape:
    """The activation a slot sees, per sample.

    cnn: ``[C, H, W]`` with ``channels=C`` and ``spatial=(H, W)``;
    transformer: ``[T, D]`` with ``channels=D``, ``spatial=(T,)`` and ``causal=True``
    (a seed must not let a token see later tokens).
    """

    kind: str
    channels: int
    spatial: tuple[int, ...]
    causal: bool = False

    @property
    def tokens(self) -> int:
        n = 1
        for s in self.spatial:
            n *= s
        return n


class BlueprintFitError(ValueError):
    """A blueprint was asked to grow in a slot whose shape it does not fit."""


@dataclass(frozen=True)
class Blueprint:
    """A named seed recipe.

    ``build`` must return a module whose output has the input's shape and is exactly zero
    at initialisation (its last layer zero-initialised), so a GERMINATED seed leaves the
    host's function unchanged. ``param_count`` must equal the built module's parameter
    count; tests check both for every registered blueprint.
    """

    name: str
    host_kinds: frozenset[str]
    build: Callable[[SlotShape], nn.Module]
    param_count: Callable[[SlotShape], int]
    #: Extra shape rules beyond the host kind: returns why the shape does not fit, or None.
    shape_rule: Callable[[SlotShape], str | None] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.host_kinds) - HOST_KINDS
        if not self.host_kinds or unknown:
            raise ValueError(
                f"blueprint {self.name!r} declares host kinds {sorted(self.host_kinds)}; "
                f"each must be one of {sorted(HOST_KINDS)}"
            )

    def why_not(self, shape: SlotShape) -> str | None:
        if shape.kind not in self.host_kinds:
            return (
                f"blueprint {self.name!r} fits host kinds {sorted(self.host_kinds)}, "
                f"not {shape.kind!r}"
            )
        if self.shape_rule is not None:
            reason = self.shape_rule(shape)
            if reason:
                return f"blueprint {self.name!r} does not fit {shape}: {reason}"
        return None

    def fits(self, shape: SlotShape) -> bool:
        return self.why_not(shape) is None

    def instantiate(self, shape: SlotShape) -> nn.Module:
        reason = self.why_not(shape)
        if reason is not None:
            raise BlueprintFitError(f"{reason}; choose a blueprint that fits this slot")
        return self.build(shape)
