"""The widening blueprint: new units for the layers around a slot (``esper.kasmina.widening``).

One name, ``widen``, for both host kinds: on a CNN slot it doubles the stage before the
slot (``CNN_WIDEN_FACTOR`` times its channels more, in every convolution of the stage);
on a Transformer slot it adds ``MLP_WIDEN_FACTOR`` times ``d_model`` hidden units to the
block's MLP.
"""

from __future__ import annotations

from torch import nn

from esper.kasmina.blueprints.spec import Blueprint, SlotShape
from esper.kasmina.widening import KERNEL, ConvWidening, MLPWidening

#: A CNN widening adds this many times the slot's channels to its stage.
CNN_WIDEN_FACTOR = 1
#: A Transformer widening adds this many times ``d_model`` hidden units to the block's MLP.
MLP_WIDEN_FACTOR = 1
NORM_PARAMS_PER_UNIT = 2  # BatchNorm's weight and bias


def widen_units(shape: SlotShape) -> int:
    factor = CNN_WIDEN_FACTOR if shape.kind == "cnn" else MLP_WIDEN_FACTOR
    return factor * shape.channels


def _build(shape: SlotShape) -> nn.Module:
    if shape.kind == "cnn":
        return ConvWidening(shape, widen_units(shape))
    return MLPWidening(shape, widen_units(shape))


def _param_count(shape: SlotShape) -> int:
    k, c = widen_units(shape), shape.channels
    if shape.kind != "cnn":
        return c * k + k + k * c  # up (with bias), down (the block's own bias stays)
    area = KERNEL * KERNEL
    first = shape.producer_in * k * area
    later = (shape.producer_layers - 1) * k * k * area
    norms = shape.producer_layers * NORM_PARAMS_PER_UNIT * k
    return first + later + norms + k * shape.consumer_out * shape.consumer_area


def _rule(shape: SlotShape) -> str | None:
    if shape.kind == "cnn" and not (
        shape.producer_in and shape.producer_layers and shape.consumer_out and shape.consumer_area
    ):
        return (
            "the slot does not say which layers surround it (SlotShape.producer_in, "
            "producer_layers, consumer_out, consumer_area); only a host's own slots can widen"
        )
    return None


def widen_blueprints() -> list[Blueprint]:
    return [
        Blueprint(
            "widen",
            frozenset({"cnn", "transformer"}),
            _build,
            _param_count,
            shape_rule=_rule,
            description=(
                f"{CNN_WIDEN_FACTOR}x the stage's channels more (CNN) or "
                f"{MLP_WIDEN_FACTOR}x d_model more MLP units (Transformer), merged when fossilized"
            ),
            operator="widen",
        )
    ]
