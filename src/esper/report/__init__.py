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

import importlib
from typing import Any

#: Where each name lives. Imported on first use: the timeline helper process
#: (``esper.report.drawer``) needs matplotlib but not the curves' statistics (scipy),
#: and starts half a second sooner without them.
_HOMES = {
    "LEARNING_CURVE_FILE": "esper.report.curves",
    "LEARNING_CURVE_SIZE": "esper.report.curves",
    "render_learning_curve": "esper.report.curves",
    "report": "esper.report.curves",
    "STAGE_COLOURS": "esper.report.timeline",
    "TIMELINE_SIZE": "esper.report.timeline",
    "render_timeline": "esper.report.timeline",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'esper.report' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "LEARNING_CURVE_FILE",
    "LEARNING_CURVE_SIZE",
    "STAGE_COLOURS",
    "TIMELINE_SIZE",
    "render_learning_curve",
    "render_timeline",
    "report",
]
