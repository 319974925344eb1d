"""What the controller can do to a slot, and how a new seed is blended in."""

from __future__ import annotations

from enum import IntEnum


class LifecycleOp(IntEnum):
    """The `op` head's choices. WAIT is always legal, so every mask has a live choice."""

    WAIT = 0
    GERMINATE = 1
    ADVANCE = 2
    PRUNE = 3


class BlendMode(IntEnum):
    """How alpha ramps from 0 to 1 during BLENDING (see ``kasmina.blending``).

    GATED ramps linearly like LINEAR, and the seed's output also passes through a
    learned per-channel gate, so the seed can learn how much of itself to admit.
    """

    LINEAR = 0
    COSINE = 1
    SIGMOID = 2
    GATED = 3
