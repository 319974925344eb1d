"""is_finite_real: the numeric test every config field starts from."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from esper.contracts.checks import is_finite_real


@pytest.mark.parametrize("value", [0, -3, 1.5, 1e-300, np.float32(0.25), Fraction(1, 3)])
def test_finite_reals_pass(value: object) -> None:
    assert is_finite_real(value)


@pytest.mark.parametrize(
    "value", [True, False, math.nan, math.inf, -math.inf, "1.0", None, 1 + 2j, [1.0]]
)
def test_bools_non_finite_and_non_numbers_fail(value: object) -> None:
    assert not is_finite_real(value)
