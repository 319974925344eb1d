"""The blueprint registry: built-in seed recipes plus those from ``esper.blueprints`` entry points.

An entry point may name a :class:`Blueprint` or a zero-argument callable returning one.
"""

from __future__ import annotations

from esper.kasmina.blueprints.channelwise import channelwise_blueprints
from esper.kasmina.blueprints.conv import conv_blueprints
from esper.kasmina.blueprints.spec import HOST_KINDS, Blueprint, BlueprintFitError, SlotShape
from esper.kasmina.blueprints.widen import widen_blueprints
from esper.plugins import Registry


def _as_blueprint(name: str, obj: object) -> Blueprint:
    if not isinstance(obj, Blueprint) and callable(obj):
        obj = obj()
    if not isinstance(obj, Blueprint):
        raise TypeError(
            f"expected an esper.kasmina.blueprints.Blueprint (or a callable returning one), "
            f"got {type(obj).__name__}"
        )
    if obj.name != name:
        raise TypeError(f"the blueprint's own name {obj.name!r} differs from its registered name")
    return obj


BLUEPRINTS: Registry[Blueprint] = Registry("esper.blueprints", "blueprint", validate=_as_blueprint)

for _bp in (*conv_blueprints(), *channelwise_blueprints(), *widen_blueprints()):
    BLUEPRINTS.register(_bp.name, _bp)


def blueprints_fitting(shape: SlotShape) -> tuple[str, ...]:
    """Names of registered blueprints that fit ``shape``, in registry order."""
    return tuple(name for name in BLUEPRINTS.names() if BLUEPRINTS.get(name).fits(shape))


__all__ = [
    "BLUEPRINTS",
    "HOST_KINDS",
    "Blueprint",
    "BlueprintFitError",
    "SlotShape",
    "blueprints_fitting",
]
