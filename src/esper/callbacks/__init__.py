"""Lightning callbacks that watch and steer a run, and their registry.

Third-party callbacks join through the entry-point group ``esper.callbacks``; an entry is a
``lightning.pytorch.Callback`` subclass, built with keyword arguments from the config.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from esper.callbacks.base import EsperCallback
from esper.callbacks.checkpoint import BestPolicyCheckpoint, EsperCheckpoint
from esper.callbacks.events import EventLogCallback
from esper.callbacks.governor import GovernorCallback
from esper.callbacks.metrics import MetricsCallback
from esper.callbacks.progress import ProgressLines
from esper.callbacks.telemetry import TelemetryCallback
from esper.callbacks.timeline import TimelineCallback
from esper.plugins import Registry


def _as_callback_class(name: str, obj: object) -> type[Callback]:
    if not (isinstance(obj, type) and issubclass(obj, Callback)):
        raise TypeError(
            f"expected a subclass of lightning.pytorch.Callback, got {obj!r}; "
            "point the entry point at the callback class, not an instance"
        )
    return obj


CALLBACKS: Registry[type[Callback]] = Registry(
    "esper.callbacks", "callback", validate=_as_callback_class
)

CALLBACKS.register("telemetry", TelemetryCallback)
CALLBACKS.register("governor", GovernorCallback)
CALLBACKS.register("last_checkpoint", EsperCheckpoint)
CALLBACKS.register("best_checkpoint", BestPolicyCheckpoint)
CALLBACKS.register("timeline", TimelineCallback)
CALLBACKS.register("progress_lines", ProgressLines)

__all__ = [
    "CALLBACKS",
    "BestPolicyCheckpoint",
    "EsperCallback",
    "EsperCheckpoint",
    "EventLogCallback",
    "GovernorCallback",
    "MetricsCallback",
    "ProgressLines",
    "TelemetryCallback",
    "TimelineCallback",
]
