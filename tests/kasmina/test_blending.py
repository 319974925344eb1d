"""Alpha schedules (kasmina/blending.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import BlendMode
from esper.kasmina.blending import blend_alpha

MODES = st.sampled_from(list(BlendMode))
PROGRESS = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@pytest.mark.parametrize("mode", list(BlendMode))
def test_alpha_is_exactly_zero_at_start_and_exactly_one_at_end(mode: BlendMode) -> None:
    assert blend_alpha(mode, 0.0) == 0.0
    assert blend_alpha(mode, 1.0) == 1.0


@given(mode=MODES, p=PROGRESS)
def test_alpha_stays_in_unit_interval(mode: BlendMode, p: float) -> None:
    assert 0.0 <= blend_alpha(mode, p) <= 1.0


@given(mode=MODES, a=PROGRESS, b=PROGRESS)
def test_alpha_is_monotone_in_progress(mode: BlendMode, a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert blend_alpha(mode, lo) <= blend_alpha(mode, hi)


@given(mode=MODES, p=st.floats(min_value=1e-6, max_value=1.0))
def test_alpha_is_positive_once_the_ramp_has_started(mode: BlendMode, p: float) -> None:
    assert blend_alpha(mode, p) > 0.0


@given(
    mode=MODES,
    p=st.one_of(
        st.floats(max_value=0.0, allow_nan=False), st.floats(min_value=1.0, allow_nan=False)
    ),
)
def test_progress_outside_the_ramp_is_clamped(mode: BlendMode, p: float) -> None:
    assert blend_alpha(mode, p) == (0.0 if p <= 0.0 else 1.0)


@given(p=PROGRESS)
def test_linear_and_gated_ramps_are_the_identity(p: float) -> None:
    assert blend_alpha(BlendMode.LINEAR, p) == p
    assert blend_alpha(BlendMode.GATED, p) == p


@pytest.mark.parametrize("mode", [BlendMode.COSINE, BlendMode.SIGMOID])
@given(p=PROGRESS)
def test_smooth_ramps_are_symmetric_about_the_midpoint(mode: BlendMode, p: float) -> None:
    assert math.isclose(blend_alpha(mode, p) + blend_alpha(mode, 1.0 - p), 1.0, abs_tol=1e-12)


def test_sigmoid_ramp_is_steep_in_the_middle() -> None:
    middle = blend_alpha(BlendMode.SIGMOID, 0.75) - blend_alpha(BlendMode.SIGMOID, 0.25)
    assert middle > 0.85
    assert middle > blend_alpha(BlendMode.LINEAR, 0.75) - blend_alpha(BlendMode.LINEAR, 0.25)


@pytest.mark.parametrize("mode", list(BlendMode))
def test_plain_int_modes_behave_like_their_enum(mode: BlendMode) -> None:
    for p in (0.0, 0.3, 0.5, 1.0):
        assert blend_alpha(int(mode), p) == blend_alpha(mode, p)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [len(BlendMode), -1, "LINEAR"])
def test_unknown_mode_raises_value_error_listing_modes(mode: object) -> None:
    with pytest.raises(ValueError, match=r"unknown blend mode.*LINEAR"):
        blend_alpha(mode, 0.5)  # type: ignore[arg-type]
