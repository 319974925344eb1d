"""Alpha schedules for BLENDING: how fast a seed's output is admitted into the host.

Pure functions of progress in [0, 1]; alpha is a host-side float, so changing it each
epoch costs no device work and no recompilation.
"""

from __future__ import annotations

import math

from esper.contracts import BlendMode

#: Steepness of the SIGMOID ramp; at 10 the middle 50% of the ramp carries ~90% of the change.
SIGMOID_STEEPNESS = 10.0


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def blend_alpha(mode: BlendMode, progress: float) -> float:
    """Alpha in [0, 1] at ``progress`` through the ramp; 0 at 0 and exactly 1 at 1 for every mode."""
    try:
        mode = BlendMode(mode)
    except ValueError:
        raise ValueError(
            f"unknown blend mode {mode!r}; choose one of {[m.name for m in BlendMode]}"
        ) from None
    p = min(max(progress, 0.0), 1.0)
    if mode in (BlendMode.LINEAR, BlendMode.GATED):
        return p
    if mode is BlendMode.COSINE:
        return 0.5 * (1.0 - math.cos(math.pi * p))
    if mode is BlendMode.SIGMOID:
        lo = _sigmoid(-0.5 * SIGMOID_STEEPNESS)
        hi = _sigmoid(0.5 * SIGMOID_STEEPNESS)
        return (_sigmoid(SIGMOID_STEEPNESS * (p - 0.5)) - lo) / (hi - lo)
    raise ValueError(f"unknown blend mode {mode!r}; choose one of {[m.name for m in BlendMode]}")
