"""Plain data shared by every domain: enums, the action-head schema, the observation layout.

Nothing here imports torch: these are the words the other domains use to talk to
each other, and they must be cheap to import and trivial to serialise.
"""

from esper.contracts.actions import ActionSchema, HeadSpec
from esper.contracts.observations import FeatureSlice, ObservationLayout
from esper.contracts.ops import BlendMode, LifecycleOp
from esper.contracts.stages import (
    LIVE_STAGES,
    TRANSITIONS,
    IllegalTransitionError,
    SeedStage,
    check_transition,
    is_legal_transition,
)

__all__ = [
    "LIVE_STAGES",
    "TRANSITIONS",
    "ActionSchema",
    "BlendMode",
    "FeatureSlice",
    "HeadSpec",
    "IllegalTransitionError",
    "LifecycleOp",
    "ObservationLayout",
    "SeedStage",
    "check_transition",
    "is_legal_transition",
]
