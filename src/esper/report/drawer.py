"""Timelines drawn in a helper process, so drawing never holds up training.

Drawing a timeline is matplotlib text layout: a few hundred milliseconds of Python that,
in the training process, either stalls the rollout (drawn in line) or takes the GIL from
the loop that launches the hosts' kernels (drawn in a thread). A profile of a 16-env CUDA
fit found it the largest single item. So :class:`BackgroundDrawer` hands each picture to
one helper process (``python -m esper.report.drawer``), started on the first picture and
fed through a pipe; the pictures come back as RGB arrays for TensorBoard, and the PNGs are
written by the helper. The helper runs at the lowest scheduling priority, so where the
hosts' training keeps every core busy it draws in the gaps rather than beside them.

A plain ``python -m`` process rather than :mod:`multiprocessing`: ``spawn`` and
``forkserver`` re-import the user's ``__main__``, which runs a script's ``Trainer.fit``
again where the script has no ``if __name__ == "__main__"`` guard, and ``fork`` copies a
process whose torch and OpenMP threads do not survive it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any, BinaryIO

import numpy as np

from esper.contracts.rollout import StepBatch

#: Pickle protocol of the pipe: both ends are this interpreter.
PROTOCOL = pickle.HIGHEST_PROTOCOL
#: How much the helper lowers its own scheduling priority (``os.nice``): it draws on the
#: cores training leaves idle instead of taking a share of those the hosts train on.
HELPER_NICENESS = 19
#: How long :meth:`BackgroundDrawer.wait` waits for the helper's next answer before it
#: takes the helper as hung and stops it. A picture takes a fraction of a second to draw
#: (benchmarks/README.md, "Timeline pictures off the training path"); the bound is far
#: above that, also for a helper drawing at the lowest priority beside busy cores.
ANSWER_TIMEOUT_S = 120.0
#: After the helper is stopped, how long ``wait`` and ``close`` wait for it to be gone.
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Job:
    """One timeline to draw: :func:`esper.report.timeline.render_timeline`'s arguments."""

    key: Any
    steps: Sequence[StepBatch]
    env: int
    slot_ids: Sequence[str]
    path: Path


@dataclass(frozen=True)
class Drawn:
    """A finished job: the picture written to ``path`` and its pixels."""

    key: Any
    path: Path
    image: np.ndarray


class DrawingError(RuntimeError):
    """The helper could not draw a picture, or stopped; the message says which and why.

    ``stopped``: the helper is gone, so no pending picture will come back.
    """

    def __init__(self, message: str, stopped: bool = False) -> None:
        super().__init__(message)
        self.stopped = stopped


class BackgroundDrawer:
    """Draws timelines in one helper process, in the order they are submitted.

    ``submit`` returns at once; ``finished`` returns what is done without waiting and
    ``wait`` what is left once it is done. A picture the helper could not draw comes back
    as a :class:`DrawingError` in its place; a helper that stopped, as one DrawingError
    for everything pending (``stopped``), and ``submit`` raises it. A helper alive but
    silent for ``answer_timeout_s`` while pictures are pending (a stuck drawing library)
    is stopped the same way, so the end of a run never waits on it for ever.
    """

    def __init__(self, answer_timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        if not answer_timeout_s > 0:
            raise ValueError(
                f"BackgroundDrawer(answer_timeout_s={answer_timeout_s!r}) must be > 0 "
                f"(seconds to wait for each picture; default {ANSWER_TIMEOUT_S})"
            )
        self.answer_timeout_s = answer_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._results: SimpleQueue[Drawn | DrawingError] = SimpleQueue()
        self._jobs: SimpleQueue[Job | None] = SimpleQueue()
        self._pending = 0
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        #: Set by the writer when the helper can no longer be sent a job.
        self._stopped: DrawingError | None = None

    @property
    def pending(self) -> int:
        """Pictures submitted and not yet handed back."""
        return self._pending

    def submit(self, job: Job) -> None:
        """Queue ``job``; a writer thread sends it, so a helper still busy with the last
        picture (its pipe full) never holds the caller up."""
        self._start()
        if self._stopped is not None:
            raise self._stopped
        self._jobs.put(job)
        self._pending += 1

    def finished(self) -> list[Drawn | DrawingError]:
        """The pictures finished since the last call, without waiting; a picture that
        could not be drawn, or the helper's end, comes back as a DrawingError in its place."""
        done = []
        while True:
            try:
                item = self._results.get_nowait()
            except Empty:
                return done
            done.append(self._take(item))

    def wait(self) -> list[Drawn | DrawingError]:
        """Every picture still pending, once drawn (as :meth:`finished`). A helper that
        answers nothing for ``answer_timeout_s`` is stopped: what it had not answered
        comes back as one DrawingError (``stopped``)."""
        done = self.finished()
        while self._pending:
            try:
                item = self._results.get(timeout=self.answer_timeout_s)
            except Empty:
                item = self._stop_hung()
            done.append(self._take(item))
        return done

    def _stop_hung(self) -> DrawingError:
        """Kill a helper that stopped answering, reap it (its pipe can close before it has
        exited) and take its end off the queue (the reader reports it there), answers it
        sent meanwhile dropped with the rest."""
        process = self._process
        if process is not None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Empty):
            while True:
                item = self._results.get(timeout=STOP_TIMEOUT_S)
                if isinstance(item, DrawingError) and item.stopped:
                    break
        return DrawingError(
            f"the timeline helper process answered nothing for {self.answer_timeout_s:g} s "
            f"with {self._pending} picture(s) pending: stopped it; those are not drawn",
            True,
        )

    def close(self) -> None:
        """Stop the helper (after what it is drawing; one silent for ``answer_timeout_s``
        is killed); pictures not collected are dropped."""
        process, self._process = self._process, None
        if process is None:
            return
        self._jobs.put(None)  # the writer sends what is queued, then closes the input
        try:
            process.wait(timeout=self.answer_timeout_s)  # its loop ends with its input
        except subprocess.TimeoutExpired:  # hung: a write to it would block for ever
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
        if self._writer is not None:
            self._writer.join()
        if self._reader is not None:
            self._reader.join()
        self._pending = 0

    def _take(self, item: Drawn | DrawingError) -> Drawn | DrawingError:
        # A stopped helper answers nothing more: what was pending is dropped.
        self._pending = 0 if isinstance(item, DrawingError) and item.stopped else self._pending - 1
        return item

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is not None:
            return self._process
        self._stopped = None
        # The helper imports the esper this process runs, wherever it was imported from.
        here = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "esper.report.drawer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            # Its own process group: a terminal's Ctrl-C stops the run, which then waits
            # for the pictures asked for, instead of killing the helper mid-picture. It
            # ends when its input does (the run closes it, or dies).
            start_new_session=True,
        )
        self._reader = threading.Thread(
            target=_read_results, args=(self._process, self._results), daemon=True
        )
        self._reader.start()
        self._writer = threading.Thread(target=self._send_jobs, daemon=True)
        self._writer.start()
        return self._process

    def _send_jobs(self) -> None:
        """The writer thread: send queued jobs until ``close`` queues None, then close the
        helper's input. A broken pipe (the helper died) is kept for ``submit`` to raise;
        the reader reports the helper's end to ``wait``."""
        process = self._process
        assert process is not None and process.stdin is not None
        with contextlib.suppress(OSError):  # closing a pipe the helper already closed
            while (job := self._jobs.get()) is not None:
                try:
                    pickle.dump(job, process.stdin, protocol=PROTOCOL)
                    process.stdin.flush()
                except OSError as exc:
                    self._stopped = DrawingError(
                        f"the timeline helper process stopped ({exc})", True
                    )
                    while self._jobs.get() is not None:  # drop the rest until close
                        pass
                    break
            process.stdin.close()


def _read_results(
    process: subprocess.Popen[bytes], results: SimpleQueue[Drawn | DrawingError]
) -> None:
    """Hand each answer of the helper to the queue; its end becomes one DrawingError
    that drops what is pending, so ``wait`` never hangs on a helper that died. An answer
    that does not unpickle leaves the stream at no known boundary: the helper is stopped,
    since nothing would read what it writes next and it would block on the full pipe
    (and ``close`` wait on it) for ever."""
    assert process.stdout is not None
    while True:
        try:
            item = pickle.load(process.stdout)
        except Exception as exc:  # EOF: the helper ended; anything else: garbage
            if not isinstance(exc, EOFError):
                process.kill()
            results.put(DrawingError(f"the timeline helper process stopped ({exc!r})", True))
            return
        results.put(item)


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """The helper's loop: draw each job read from ``source`` and write the result (or a
    DrawingError naming the picture) to ``sink``, until ``source`` ends."""
    from esper.report.timeline import render_timeline

    while True:
        try:
            job: Job = pickle.load(source)
        except EOFError:
            return
        try:
            image = render_timeline(job.steps, job.env, job.slot_ids, path=job.path)
            answer: Drawn | DrawingError = Drawn(job.key, job.path, image)
        except Exception as exc:  # sent back and raised in the training process
            answer = DrawingError(f"drawing {job.path} failed: {type(exc).__name__}: {exc}")
        _write_all(sink, pickle.dumps(answer, protocol=PROTOCOL))
        sink.flush()


def _write_all(sink: BinaryIO, data: bytes) -> None:
    """Write every byte of ``data``. The helper's stdout is an unbuffered ``FileIO`` where
    Python runs unbuffered (``-u``, ``PYTHONUNBUFFERED``), and a pipe write of a picture
    (far larger than the pipe) that a signal interrupts part way, as a profiler's
    ptrace or a SIGSTOP/SIGCONT does, returns the count written: ``pickle.dump`` dropped
    the rest, and the training process then waited for bytes that never came."""
    view = memoryview(data)
    while view:
        written = sink.write(view)
        view = view[written if written is not None else 0 :]


if __name__ == "__main__":
    # Imported by name, so the answers pickle as esper.report.drawer's classes, not
    # __main__'s. Results go through the real stdout; anything printed goes to stderr.
    from esper.report.drawer import serve as serve_jobs

    if hasattr(os, "nice"):  # POSIX; elsewhere the helper draws at normal priority
        os.nice(HELPER_NICENESS)
    results = sys.stdout.buffer
    sys.stdout = sys.stderr
    serve_jobs(sys.stdin.buffer, results)
