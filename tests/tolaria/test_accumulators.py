"""An env's running sums over a host epoch (tolaria/accumulators.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from esper.tolaria.accumulators import finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_is_isfinite_at_the_edges(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    values = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, info.tiny / 4, math.inf,
         -math.inf, math.nan],
        dtype=dtype,
    )  # fmt: skip
    assert torch.equal(finite(values), torch.isfinite(values))


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=64))
def test_finite_is_isfinite_for_any_floats(values: list[float]) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(finite(tensor), torch.isfinite(tensor))
