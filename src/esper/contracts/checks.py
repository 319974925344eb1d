"""The one test every numeric config field starts from.

``True`` is a ``numbers.Real`` and NaN/infinity compare oddly, so "is a real number" alone
lets caller bugs through; every config validates with this instead of its own copy.
"""

from __future__ import annotations

import math
import numbers


def is_finite_real(value: object) -> bool:
    """A real number that is not a bool, NaN or infinite."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
