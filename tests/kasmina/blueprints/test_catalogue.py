"""Every registered blueprint honours its declaration (kasmina/blueprints/__init__.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esper.contracts import BlendMode
from esper.kasmina import BlueprintFitError, CNNHost, SlotShape, TransformerHost
from esper.kasmina.blueprints import BLUEPRINTS, Blueprint, blueprints_fitting
from esper.kasmina.blueprints import _as_blueprint as as_blueprint

#: The built-in residual blueprints (``widen``, the widening one, is pinned in
#: tests/kasmina/test_widening.py: its output is new units, not a block's zero delta).
BUILTIN = (
    "conv_light",
    "conv_heavy",
    "conv_wide",
    "depthwise",
    "bottleneck",
    "attention",
    "norm",
    "lora",
    "mlp",
)

#: The slot shapes of the hosts Esper ships: digits CNN, CIFAR-10 CNN, default Transformer.
HOST_SHAPES: dict[str, list[SlotShape]] = {
    "cnn": [
        *(s.shape for s in CNNHost((1, 8, 8)).iter_slots()),
        *(s.shape for s in CNNHost((3, 32, 32)).iter_slots()),
    ],
    "transformer": [s.shape for s in TransformerHost().iter_slots()],
}

FITTING = [
    pytest.param(
        name, shape, id=f"{name}-{shape.kind}-{shape.channels}x{'x'.join(map(str, shape.spatial))}"
    )
    for name in BUILTIN
    for kind in sorted(BLUEPRINTS.get(name).host_kinds)
    for shape in dict.fromkeys(HOST_SHAPES[kind])
]

#: Shapes each blueprint must refuse: another host kind, and the limits of its own rules.
NOT_FITTING = [
    pytest.param(name, shape, id=f"{name}-{i}")
    for name, shapes in {
        "conv_light": [SlotShape("transformer", 64, (32,), causal=True)],
        "conv_heavy": [SlotShape("transformer", 64, (32,), causal=True)],
        "conv_wide": [SlotShape("transformer", 64, (32,), causal=True)],
        "depthwise": [SlotShape("transformer", 16, (8,), causal=True)],
        "bottleneck": [
            SlotShape("transformer", 64, (32,), causal=True),
            SlotShape("cnn", 3, (8, 8)),
        ],
        "attention": [
            SlotShape("cnn", 24, (8, 8)),
            SlotShape("cnn", 16, (64, 64)),
            SlotShape("transformer", 8, (4,), causal=True),
        ],
        "norm": [SlotShape("rnn", 16, (4,))],
        "lora": [SlotShape("cnn", 4, (8, 8)), SlotShape("transformer", 2, (8,), causal=True)],
        "mlp": [SlotShape("rnn", 16, (4,))],
    }.items()
    for i, shape in enumerate(shapes)
]


def _input(shape: SlotShape, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, *shape.spatial, shape.channels, generator=g)
        if shape.kind == "transformer"
        else torch.randn(batch, shape.channels, *shape.spatial, generator=g)
    )


def test_registry_holds_the_builtin_blueprints_in_order() -> None:
    assert BLUEPRINTS.names()[: len(BUILTIN) + 1] == (*BUILTIN, "widen")
    assert all(BLUEPRINTS.get(name).operator == "residual" for name in BUILTIN)
    assert BLUEPRINTS.get("widen").operator == "widen"
    for name in (*BUILTIN, "widen"):
        assert BLUEPRINTS.entry(name).source == "esper (built-in)"
        assert BLUEPRINTS.get(name).name == name
        assert BLUEPRINTS.get(name).description


def test_every_builtin_has_a_fitting_and_a_non_fitting_case() -> None:
    assert {p.values[0] for p in FITTING} == set(BUILTIN)
    assert {p.values[0] for p in NOT_FITTING} == set(BUILTIN)


@pytest.mark.parametrize(("name", "shape"), FITTING)
def test_blueprint_fits_its_declared_shapes_with_exact_param_count_and_zero_output(
    name: str, shape: SlotShape
) -> None:
    bp = BLUEPRINTS.get(name)
    assert bp.fits(shape)
    assert bp.why_not(shape) is None
    torch.manual_seed(0)
    module = bp.instantiate(shape)
    assert bp.param_count(shape) == sum(p.numel() for p in module.parameters())
    x = _input(shape)
    with torch.no_grad():
        y = module(x)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert not bool(y.any()), "a freshly planted seed must output exactly zero"


@pytest.mark.parametrize(("name", "shape"), NOT_FITTING)
def test_blueprint_refuses_shapes_it_does_not_fit_with_a_reason_naming_it(
    name: str, shape: SlotShape
) -> None:
    bp = BLUEPRINTS.get(name)
    assert not bp.fits(shape)
    assert f"blueprint {name!r}" in (bp.why_not(shape) or "")
    with pytest.raises(BlueprintFitError, match=f"blueprint '{name}'") as info:
        bp.instantiate(shape)
    assert "choose a blueprint that fits" in str(info.value)


def test_germinating_conv_light_on_a_transformer_slot_raises_one_fit_error() -> None:
    host = TransformerHost()
    with pytest.raises(
        BlueprintFitError, match="'conv_light' fits host kinds \\['cnn'\\], not 'transformer'"
    ):
        host.slot("block0").germinate("conv_light", BlendMode.LINEAR)


def _shapes_for(bp: Blueprint) -> st.SearchStrategy[SlotShape]:
    cnn = st.builds(
        SlotShape,
        kind=st.just("cnn"),
        channels=st.integers(1, 40),
        spatial=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    )
    transformer = st.builds(
        SlotShape,
        kind=st.just("transformer"),
        channels=st.integers(1, 40),
        spatial=st.tuples(st.integers(1, 8)),
        causal=st.just(True),
    )
    kinds = [s for k, s in (("cnn", cnn), ("transformer", transformer)) if k in bp.host_kinds]
    return st.one_of(*kinds)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(BUILTIN))
def test_param_count_and_zero_output_hold_for_any_fitting_shape(
    data: st.DataObject, name: str
) -> None:
    bp = BLUEPRINTS.get(name)
    shape = data.draw(_shapes_for(bp))
    if not bp.fits(shape):
        with pytest.raises(BlueprintFitError):
            bp.instantiate(shape)
        return
    module = bp.instantiate(shape)
    assert bp.param_count(shape) == sum(p.numel() for p in module.parameters())
    x = _input(shape)
    with torch.no_grad():
        y = module(x)
    assert y.shape == x.shape
    assert not bool(y.any())


@pytest.mark.parametrize("kind", sorted(HOST_SHAPES))
def test_blueprints_fitting_lists_exactly_the_fitting_ones_in_registry_order(kind: str) -> None:
    for shape in HOST_SHAPES[kind]:
        expected = tuple(n for n in BLUEPRINTS.names() if BLUEPRINTS.get(n).fits(shape))
        assert blueprints_fitting(shape) == expected
    assert blueprints_fitting(SlotShape("transformer", 64, (32,), causal=True)) == (
        "attention",
        "norm",
        "lora",
        "mlp",
        "widen",
    )
    # A CNN slot that does not say which layers surround it cannot widen.
    assert set(blueprints_fitting(SlotShape("cnn", 16, (8, 8)))) == set(BUILTIN)


def test_registry_validation_accepts_factories_and_rejects_other_objects() -> None:
    bp = BLUEPRINTS.get("norm")
    assert as_blueprint("norm", bp) is bp
    assert as_blueprint("norm", lambda: bp) is bp
    with pytest.raises(TypeError, match=r"expected an esper\.kasmina\.blueprints\.Blueprint"):
        as_blueprint("norm", 42)
    with pytest.raises(TypeError, match=r"expected an esper\.kasmina\.blueprints\.Blueprint"):
        as_blueprint("norm", lambda: "not a blueprint")
    with pytest.raises(TypeError, match="'norm' differs from its registered name"):
        as_blueprint("other", bp)
