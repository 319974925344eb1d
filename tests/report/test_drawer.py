"""Timelines drawn in the helper process: the same pictures, never drawn in the caller."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import esper.report.timeline as timeline
from esper.report.drawer import HELPER_NICENESS, BackgroundDrawer, DrawingError, Job
from esper.report.timeline import render_timeline

#: Between stops of the helper, and how long all its pictures may take while it is stopped.
STORM_PAUSE_S = 0.004
STORM_LIMIT_S = 30.0


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


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_pictures_survive_a_helper_stopped_and_continued_mid_answer(
    rollout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profiler attaching (ptrace) or SIGSTOP/SIGCONT interrupts the helper's write of a
    picture part way; where Python runs unbuffered its stdout is a raw pipe that writes only
    part, and the rest was lost: the run waited for it for ever."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # the raw, short-writing stdout
    steps, slot_ids = rollout
    n_pictures = 4
    drawer = BackgroundDrawer()
    try:
        for key in range(n_pictures):
            drawer.submit(Job(key, steps, 0, slot_ids, tmp_path / f"t{key}.png"))
        assert drawer._process is not None
        pid, done, drawn = drawer._process.pid, threading.Event(), []
        start = time.monotonic()
        waiter = threading.Thread(target=lambda: (drawn.extend(drawer.wait()), done.set()))
        waiter.start()
        while not done.wait(STORM_PAUSE_S):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STORM_PAUSE_S / 4)
            os.kill(pid, signal.SIGCONT)
            assert time.monotonic() - start < STORM_LIMIT_S, "an answer was lost"
        waiter.join()
    finally:
        drawer.close()
    assert [d.key for d in drawn] == list(range(n_pictures)), drawn


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_a_helper_alive_but_silent_is_stopped_not_waited_on_for_ever(
    rollout, tmp_path: Path
) -> None:
    """A stuck drawing library would leave the helper alive and silent: the end of the run
    waited on it for ever. Now ``wait`` gives up on it after ``answer_timeout_s``."""
    steps, slot_ids = rollout
    drawer = BackgroundDrawer(answer_timeout_s=1.0)
    results: list[object] = []
    try:
        for key in range(2):
            drawer.submit(Job(key, steps, 0, slot_ids, tmp_path / f"t{key}.png"))
        process = drawer._process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)  # before it could answer (it is importing)
        waiter = threading.Thread(target=lambda: results.extend(drawer.wait()), daemon=True)
        waiter.start()
        waiter.join(STORM_LIMIT_S)
        assert not waiter.is_alive(), "wait() waited on a silent helper for ever"
        (stopped,) = results
        assert isinstance(stopped, DrawingError) and stopped.stopped, stopped
        assert "answered nothing for 1 s with 2 picture(s) pending" in str(stopped)
        assert process.poll() is not None and drawer.pending == 0  # killed, nothing owed
    finally:
        closer = threading.Thread(target=drawer.close, daemon=True)
        closer.start()
        closer.join(STORM_LIMIT_S)
    assert not closer.is_alive(), "close() waited on a killed helper"


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_close_kills_a_helper_that_never_finishes(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    drawer = BackgroundDrawer(answer_timeout_s=1.0)
    drawer.submit(Job(0, steps, 0, slot_ids, tmp_path / "t.png"))
    process = drawer._process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    closer = threading.Thread(target=drawer.close, daemon=True)
    closer.start()
    closer.join(STORM_LIMIT_S)
    assert not closer.is_alive(), "close() waited on a silent helper for ever"
    assert process.poll() is not None


def test_a_drawer_without_a_positive_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"answer_timeout_s=0\) must be > 0"):
        BackgroundDrawer(answer_timeout_s=0)
