"""What a blueprint is and how it refuses a slot (kasmina/blueprints/spec.py)."""

from __future__ import annotations

import pytest
from torch import nn

from esper.kasmina.blueprints.spec import HOST_KINDS, Blueprint, BlueprintFitError, SlotShape


def _linear_bp(**kwargs) -> Blueprint:
    defaults = dict(
        name="tiny",
        host_kinds=frozenset({"transformer"}),
        build=lambda s: nn.Linear(s.channels, s.channels),
        param_count=lambda s: s.channels**2 + s.channels,
    )
    return Blueprint(**{**defaults, **kwargs})


def test_host_kinds_are_cnn_and_transformer() -> None:
    assert frozenset({"cnn", "transformer"}) == HOST_KINDS


@pytest.mark.parametrize("kinds", [frozenset(), frozenset({"rnn"}), frozenset({"cnn", "mlp"})])
def test_blueprint_with_empty_or_unknown_host_kinds_is_rejected(kinds: frozenset[str]) -> None:
    with pytest.raises(ValueError, match="blueprint 'tiny' declares host kinds"):
        _linear_bp(host_kinds=kinds)


def test_slot_shape_tokens_is_the_product_of_spatial_sizes() -> None:
    assert SlotShape("cnn", 8, (4, 5)).tokens == 20
    assert SlotShape("transformer", 8, (7,), causal=True).tokens == 7
    assert SlotShape("cnn", 8, ()).tokens == 1


def test_wrong_host_kind_is_refused_naming_blueprint_and_kinds() -> None:
    bp = _linear_bp()
    shape = SlotShape("cnn", 8, (4, 4))
    assert not bp.fits(shape)
    assert bp.why_not(shape) == "blueprint 'tiny' fits host kinds ['transformer'], not 'cnn'"


def test_shape_rule_reason_is_reported_with_the_blueprint_and_shape() -> None:
    bp = _linear_bp(shape_rule=lambda s: "too wide" if s.channels > 8 else None)
    assert bp.fits(SlotShape("transformer", 8, (4,)))
    wide = SlotShape("transformer", 9, (4,))
    reason = bp.why_not(wide)
    assert reason is not None
    assert reason.startswith("blueprint 'tiny' does not fit SlotShape(")
    assert reason.endswith(": too wide")
    with pytest.raises(BlueprintFitError, match="too wide; choose a blueprint that fits"):
        bp.instantiate(wide)


def test_fit_error_is_a_value_error() -> None:
    assert issubclass(BlueprintFitError, ValueError)


def test_instantiate_builds_only_when_the_shape_fits() -> None:
    built: list[SlotShape] = []

    def build(s: SlotShape) -> nn.Module:
        built.append(s)
        return nn.Identity()

    bp = _linear_bp(build=build)
    with pytest.raises(BlueprintFitError):
        bp.instantiate(SlotShape("cnn", 4, (2, 2)))
    assert built == []
    shape = SlotShape("transformer", 4, (2,))
    assert isinstance(bp.instantiate(shape), nn.Identity)
    assert built == [shape]
