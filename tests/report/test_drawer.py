"""Timelines drawn in the helper process: the same pictures, never drawn in the caller."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import esper.report.timeline as timeline
from esper.report.drawer import HELPER_NICENESS, BackgroundDrawer, DrawingError, Job
from esper.report.timeline import render_timeline


def test_the_helper_draws_the_picture_the_caller_would_and_writes_it(
    rollout, tmp_path: Path
) -> None:
    steps, slot_ids = rollout
    drawer = BackgroundDrawer()
    try:
        for env in (0, 1):
            drawer.submit(Job(env, steps, env, slot_ids, tmp_path / f"env{env}.png"))
        drawn = drawer.wait()
    finally:
        drawer.close()
    assert [d.key for d in drawn] == [0, 1]  # in the order asked
    for d in drawn:
        expected = render_timeline(steps, d.key, slot_ids)
        assert np.array_equal(d.image, expected)
        assert d.path.is_file()


def test_nothing_is_drawn_in_the_calling_process(
    rollout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, slot_ids = rollout

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("drawn in the training process")

    monkeypatch.setattr(timeline, "render_timeline", refuse)
    drawer = BackgroundDrawer()
    try:
        drawer.submit(Job("k", steps, 0, slot_ids, tmp_path / "t.png"))
        assert drawer.pending == 1
        (drawn,) = drawer.wait()
    finally:
        drawer.close()
    assert drawn.key == "k" and (tmp_path / "t.png").is_file() and drawer.pending == 0


def test_a_picture_that_cannot_be_drawn_is_an_error_naming_it(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    drawer = BackgroundDrawer()
    try:
        drawer.submit(Job(0, steps, 0, ["only_one_slot"], tmp_path / "bad.png"))
        drawer.submit(Job(1, steps, 0, slot_ids, tmp_path / "good.png"))
        failed, drawn = drawer.wait()
        assert isinstance(failed, DrawingError) and not failed.stopped
        assert re.search(r"bad\.png failed: ValueError", str(failed)), str(failed)
        assert drawn.key == 1 and drawer.pending == 0  # the next picture is still drawn
    finally:
        drawer.close()


def test_a_helper_that_dies_is_an_error_not_a_hang(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    drawer = BackgroundDrawer()
    try:
        drawer.submit(Job(0, steps, 0, slot_ids, tmp_path / "first.png"))
        drawer.wait()
        process = drawer._process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait()
        drawer.submit(Job(1, steps, 0, slot_ids, tmp_path / "second.png"))  # queued
        (stopped,) = drawer.wait()  # the helper's end: one error for what was pending
        assert isinstance(stopped, DrawingError) and stopped.stopped and drawer.pending == 0
        assert "stopped" in str(stopped)
    finally:
        drawer.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs POSIX priorities")
def test_the_helper_draws_at_the_lowest_priority(rollout, tmp_path: Path) -> None:
    """Where training keeps every core busy, the helper takes only the cores left idle."""
    steps, slot_ids = rollout
    drawer = BackgroundDrawer()
    try:
        drawer.submit(Job(0, steps, 0, slot_ids, tmp_path / "first.png"))
        drawer.wait()
        assert drawer._process is not None
        helper = os.getpriority(os.PRIO_PROCESS, drawer._process.pid)
        assert helper == min(os.getpriority(os.PRIO_PROCESS, 0) + HELPER_NICENESS, 19)
    finally:
        drawer.close()
