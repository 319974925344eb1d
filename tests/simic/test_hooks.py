"""The training loop's callback dispatch (simic/hooks.py): Esper callbacks in order, a
raising hook named, at most one governor."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from esper.callbacks import GovernorCallback
from esper.callbacks.base import EsperCallback
from esper.simic.hooks import CallbackError, RolloutHooks, governor_among


class Recording(EsperCallback):
    def __init__(self, name: str, calls: list[tuple[str, str, Any]]) -> None:
        self.name, self.calls = name, calls

    def on_rollout_start(self, trainer: Any, pl_module: Any, rollout: int) -> None:
        self.calls.append((self.name, "on_rollout_start", (trainer, pl_module, rollout)))


class Broken(EsperCallback):
    def on_rollout_start(self, trainer: Any, pl_module: Any, rollout: int) -> None:
        raise KeyError("no such column")


def test_every_esper_callback_gets_the_hook_in_order_and_plain_ones_none() -> None:
    calls: list[tuple[str, str, Any]] = []
    hooks = RolloutHooks([Recording("a", calls), Callback(), Recording("b", calls)], "T", "M")
    hooks("on_rollout_start", 3)
    assert calls == [
        ("a", "on_rollout_start", ("T", "M", 3)),
        ("b", "on_rollout_start", ("T", "M", 3)),
    ]


def test_a_raising_hook_is_named_with_its_callback_and_stops_the_others() -> None:
    calls: list[tuple[str, str, Any]] = []
    hooks = RolloutHooks([Broken(), Recording("after", calls)], None, None)
    with pytest.raises(CallbackError, match=r"callback Broken\.on_rollout_start raised KeyError"):
        hooks("on_rollout_start", 0)
    assert calls == []


def test_one_governor_is_found_and_two_are_refused() -> None:
    governor = GovernorCallback()
    assert governor_among([Callback(), governor]) is governor
    assert governor_among([Callback()]) is None
    with pytest.raises(ValueError, match="at most one governor"):
        governor_among([governor, GovernorCallback()])
