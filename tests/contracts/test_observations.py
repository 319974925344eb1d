"""The flat observation layout (contracts/observations.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import FeatureSlice, ObservationLayout, SeedStage
from esper.contracts.observations import GLOBAL_FEATURES, SLOT_SCALAR_FEATURES


@given(n_slots=st.integers(1, 16), n_blueprints=st.integers(1, 32))
def test_slices_are_contiguous_from_zero_and_dim_is_sum_of_widths(
    n_slots: int, n_blueprints: int
) -> None:
    layout = ObservationLayout(n_slots, n_blueprints)
    slices = layout.slices
    assert slices[0].start == 0
    for a, b in itertools.pairwise(slices):
        assert a.stop == b.start
    assert all(s.width >= 1 for s in slices)
    assert layout.dim == sum(s.width for s in slices) == slices[-1].stop
    assert len({s.name for s in slices}) == len(slices)


@given(n_slots=st.integers(1, 16), n_blueprints=st.integers(1, 32))
def test_each_slot_block_has_slot_width(n_slots: int, n_blueprints: int) -> None:
    layout = ObservationLayout(n_slots, n_blueprints)
    g = len(GLOBAL_FEATURES)
    for slot in range(n_slots):
        first = layout[f"slot{slot}.{SLOT_SCALAR_FEATURES[0]}"]
        last = layout[f"slot{slot}.blueprint"]
        assert first.start == g + slot * layout.slot_width
        assert last.stop - first.start == layout.slot_width


def test_stage_and_blueprint_one_hots_have_their_cardinality() -> None:
    layout = ObservationLayout(n_slots=2, n_blueprints=5)
    assert layout["slot1.stage"].width == len(SeedStage)
    assert layout["slot0.blueprint"].width == 5
    assert layout["val_acc"] == FeatureSlice("val_acc", 4, 5)


def test_global_features_come_first_in_declared_order() -> None:
    layout = ObservationLayout(1, 1)
    names = [s.name for s in layout.slices[: len(GLOBAL_FEATURES)]]
    assert names == list(GLOBAL_FEATURES)


def test_unknown_feature_name_raises_key_error_naming_it() -> None:
    with pytest.raises(KeyError, match="nope"):
        ObservationLayout(1, 1)["nope"]
    with pytest.raises(KeyError, match=r"slot3\.alpha"):
        ObservationLayout(2, 1)["slot3.alpha"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_slots": 0, "n_blueprints": 1}, "n_slots"),
        ({"n_slots": 1, "n_blueprints": 0}, "n_blueprints"),
    ],
)
def test_layout_rejects_non_positive_counts_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"ObservationLayout.{field}"):
        ObservationLayout(**kwargs)
