"""Pictures of a run: per-env seed timelines and learning curves, as PNG and arrays.

* :func:`render_timeline`: one env's episode (seed stage per slot and host epoch, lifecycle
  events, the host's accuracy) from the :class:`~esper.contracts.rollout.StepBatch` list
  of one rollout; :class:`~esper.callbacks.timeline.TimelineCallback` draws it during
  training.
* :func:`render_learning_curve`: mean episode return and host accuracy per PPO update from
  the telemetry ``events.jsonl``.
* :func:`report`: ``learning_curve.png`` beside every ``events.jsonl`` under a run
  directory (``esper report RUN_DIR``).

Drawn with matplotlib on its Agg canvas; no global backend state is changed.
"""

from __future__ import annotations

from esper.report.curves import (
    LEARNING_CURVE_FILE,
    LEARNING_CURVE_SIZE,
    render_learning_curve,
    report,
)
from esper.report.timeline import STAGE_COLOURS, TIMELINE_SIZE, render_timeline

__all__ = [
    "LEARNING_CURVE_FILE",
    "LEARNING_CURVE_SIZE",
    "STAGE_COLOURS",
    "TIMELINE_SIZE",
    "render_learning_curve",
    "render_timeline",
    "report",
]
