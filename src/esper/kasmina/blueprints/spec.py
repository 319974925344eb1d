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
#: How a seed may join its host (see :class:`Blueprint`).
OPERATORS: frozenset[str] = frozenset({"residual", "widen"})


@dataclass(frozen=True)
class SlotShape:
    """The activation a slot sees, per sample.

    cnn: ``[C, H, W]`` with ``channels=C`` and ``spatial=(H, W)``;
    transformer: ``[T, D]`` with ``channels=D``, ``spatial=(T,)`` and ``causal=True``
    (a seed must not let a token see later tokens).

    A widening seed (``Blueprint.operator == "widen"``) grows the layers around the slot,
    not the activation, so it is sized by them too: on a CNN slot the stage before it
    (``producer_in`` input channels, ``producer_layers`` convolutions) and the layer
    after it (``consumer_out`` outputs, each reading a ``consumer_area`` window per input
    channel: 9 for the next stage's 3x3 convolution, 1 for the linear head). Zero where
    the host does not say (a slot built alone): widening blueprints then do not fit.
    These are the widths the host was built with; they never change, so every count
    a mask computes from them at the start of an episode stays exact.
    """

    kind: str
    channels: int
    spatial: tuple[int, ...]
    causal: bool = False
    producer_in: int = 0
    producer_layers: int = 0
    consumer_out: int = 0
    consumer_area: int = 0

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

    ``build`` must return a module whose output adds exactly nothing to the host at
    initialisation, so a GERMINATED seed leaves the host's function unchanged.
    ``param_count`` must equal the built module's parameter count; tests check both for
    every registered blueprint.

    ``operator`` says how the seed joins the host:

    * ``"residual"``: a block beside the activation, ``h + alpha * seed(h)``, its last
      layer zero-initialised (a block inserted as an identity: growth in depth);
    * ``"widen"``: new units of the layers around the slot (a
      :class:`esper.kasmina.widening.Widening`), their outgoing weights zero; fossilizing
      merges them into those layers, so the host becomes a plain wider network.
    """

    name: str
    host_kinds: frozenset[str]
    build: Callable[[SlotShape], nn.Module]
    param_count: Callable[[SlotShape], int]
    #: Extra shape rules beyond the host kind: returns why the shape does not fit, or None.
    shape_rule: Callable[[SlotShape], str | None] | None = None
    description: str = ""
    operator: str = "residual"

    def __post_init__(self) -> None:
        if self.operator not in OPERATORS:
            raise ValueError(
                f"blueprint {self.name!r} has operator {self.operator!r}; "
                f"it must be one of {sorted(OPERATORS)}"
            )
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
