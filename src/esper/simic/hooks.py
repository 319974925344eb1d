"""Calling the trainer's Esper callbacks from the training loop, and finding its governor.

Each rollout hook is called on every :class:`~esper.callbacks.base.EsperCallback` among
the trainer's callbacks, in their order; a hook that raises ends the update with a
:class:`CallbackError` naming the callback and the hook, so a plugin's bug is not
mistaken for Esper's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from esper.callbacks.base import EsperCallback
from esper.mdp.governor import Governor


class CallbackError(RuntimeError):
    """A callback's rollout hook raised; the message names the callback and the hook."""


class RolloutHooks:
    """The Esper callbacks of ``callbacks``, called with ``trainer`` and ``module``."""

    def __init__(self, callbacks: Sequence[object], trainer: Any, module: Any) -> None:
        self.callbacks = [cb for cb in callbacks if isinstance(cb, EsperCallback)]
        self.trainer, self.module = trainer, module

    def __call__(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every Esper callback with ``(trainer, module, *args)``."""
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(self.trainer, self.module, *args)
            except Exception as exc:
                raise CallbackError(
                    f"callback {type(callback).__name__}.{hook} raised {type(exc).__name__}: {exc}"
                ) from exc


def governor_among(callbacks: Sequence[object]) -> Governor | None:
    """The one governor among ``callbacks`` (None: none); it steers every rollout."""
    found = [cb for cb in callbacks if isinstance(cb, Governor)]
    if len(found) > 1:
        names = ", ".join(type(cb).__name__ for cb in found)
        raise ValueError(f"at most one governor callback may steer the rollout, got {names}")
    return found[0] if found else None
