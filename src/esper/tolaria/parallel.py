"""CPU worker threads for host training: envs of one epoch train at the same time.

On a CPU, each env's convolutions are too small to keep two intra-op threads busy, and
envs used to train one after another, so every core but one sat mostly idle. Torch ops
release the GIL while they compute, so one Python thread per core keeps every core busy;
each runs its ops on one intra-op thread, so the threads do not oversubscribe the cores.
(Processes would need the hosts, their optimizers and the batches to cross process
boundaries every epoch; threads share them.)

An env is in at most one worker at a time, takes its batches in order, and shares no
tensor it writes and no random stream with another env, so its figures do not depend on
how threads are scheduled: the results equal the sequential path's bit for bit, as long
as both run each op on the same number of intra-op threads
(``tests/tolaria/test_parallel.py``).

Work is handed out a step at a time, not an env group at a time: an idle worker takes
whichever env is free and has its next batch drawn, trains it on that batch and puts it
back. Envs cost different amounts (a seed in TRAINING adds an incubation pass, each
contributing seed a validation replica), so fixed halves left one core waiting for the
other. An idle worker takes the free env with the most work left, not the longest
waiting: an env's steps run one after another, so the env that would finish last sets
the epoch's end, and an env whose steps cost more, taken in turn, fell behind and
trained, then validated, alone while the other cores waited (figures: benchmarks/
README.md, "Design figures kept out of docstrings"). Work left is estimated from the
env's own steps so far this epoch, plus its validation: the seconds the caller expects it
to take (its last epoch's, measured), else :data:`VALIDATION_STEPS` of its steps. An env
whose validation carries counterfactual replicas validates several times longer than
one without, and once its validation is known to be long it trains first, so that it does
not validate alone at the epoch's end. The order in which envs are taken changes nothing
in any env's results.
The calling thread draws the loader's batches once, as the workers train (collation
overlaps training), then the validation batches; a batch is let go once every env has
trained on it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

import torch

from esper.host_reads import counting_in_this_thread
from esper.sigint import python_handles_sigint
from esper.threads import intra_op_threads

T = TypeVar("T")
V = TypeVar("V")
R = TypeVar("R")

#: How many of an env's own training steps its validation is taken to cost, when a
#: worker picks the env with the most work left. Measured on the predecessor's host
#: (200 validation images against 16 per step, with counterfactual replicas): 4 to 7.
VALIDATION_STEPS = 5


def resolve_workers(requested: int | None, n_envs: int) -> int:
    """How many workers train ``n_envs`` envs: ``requested``, or (None) every core torch
    uses for intra-op work (its default is the physical cores, and ``OMP_NUM_THREADS``
    or ``torch.set_num_threads`` lower it), never more than there are envs."""
    wanted = torch.get_num_threads() if requested is None else requested
    return max(1, min(wanted, n_envs))


def threads_per_worker(workers: int) -> int:
    """Intra-op threads of each of ``workers`` workers: the calling thread's count (every
    core torch uses, unless lowered) shared out evenly, at least one. Results depend on
    it as they do on any thread count: a worker with k threads computes what the
    sequential path computes on k threads, bit for bit."""
    return max(1, torch.get_num_threads() // workers)


class _Schedule(Generic[T, V, R]):
    """Shared state of one :func:`run_env_steps` call, guarded by ``cond``."""

    def __init__(
        self, n_envs: int, expected: int, finish_seconds: Sequence[float | None] | None = None
    ) -> None:
        self.cond = threading.Condition()
        #: Batches the epoch is known to hold (``len`` of the iterable, else 0).
        self.expected = expected
        #: Seconds each env's finish is expected to take (None: unknown).
        self.finish_seconds = list(finish_seconds) if finish_seconds else [None] * n_envs
        #: Seconds each env's steps took so far.
        self.spent = [0.0] * n_envs
        self.drawn: list[T | None] = []
        self.released = 0  # batches before this index were let go
        self.tail: V | None = None
        self.all_drawn = False
        self.next_batch = [0] * n_envs
        self.ready: deque[int] = deque(range(n_envs))
        self.results: list[R | None] = [None] * n_envs
        self.unfinished = n_envs
        self.error: BaseException | None = None

    def take(self) -> tuple[int, int | None] | None:
        """The free env with the most work left that can go on, with its next batch index
        (None: it is done training); None when the work is over. Call with ``cond`` held;
        waits until one is free."""
        while True:
            if self.error is not None or self.unfinished == 0:
                return None
            able = [
                env
                for env in self.ready
                if self.all_drawn or self.next_batch[env] < len(self.drawn)
            ]
            if able:
                env = max(able, key=self._work_left)  # the first of equals: in turn
                self.ready.remove(env)
                if self.next_batch[env] < len(self.drawn):
                    return env, self.next_batch[env]
                return env, None
            self.cond.wait()

    def _work_left(self, env: int) -> float:
        """Seconds ``env`` has left, at its own mean step so far (the envs' mean before
        its first step; all equal before any step), its finish at the seconds expected of
        it or at :data:`VALIDATION_STEPS` steps."""
        done = self.next_batch[env]
        if done:
            per_step = self.spent[env] / done
        else:
            timed = [s / n for s, n in zip(self.spent, self.next_batch, strict=True) if n]
            per_step = sum(timed) / len(timed) if timed else 1.0
        batches = max(self.expected, len(self.drawn))
        finish = self.finish_seconds[env]
        if finish is None:
            return (batches - done + VALIDATION_STEPS) * per_step
        return (batches - done) * per_step + finish

    def stepped(self, env: int, seconds: float) -> None:
        """``env`` trained on its batch in ``seconds``: put it back, and let go of batches
        every env is past."""
        self.next_batch[env] += 1
        self.spent[env] += seconds
        self.ready.append(env)
        lowest = min(self.next_batch)
        while self.released < lowest:
            self.drawn[self.released] = None
            self.released += 1
        self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.cond.notify_all()


def _known_length(batches: Iterable[object]) -> int:
    """How many batches ``batches`` holds where it says (0 where it cannot: a generator,
    or a DataLoader over an iterable dataset, whose ``len`` raises)."""
    try:
        return len(batches)  # type: ignore[arg-type]
    except TypeError:
        return 0


def run_env_steps(
    n_envs: int,
    workers: int,
    batches: Iterable[T],
    tail: Callable[[], V],
    step: Callable[[int, int, T], None],
    finish: Callable[[int, V], R],
    finish_seconds: Sequence[float | None] | None = None,
) -> list[R]:
    """``step(env, b, batch)`` for every env on every batch in order, then ``finish(env,
    tail())``, in ``workers`` threads; the ``finish`` results in env order.
    ``finish_seconds[env]``, where given, is how long ``env``'s finish is expected to take
    (None: unknown); it only orders the work.

    The calling thread iterates ``batches`` once while the workers run, then calls
    ``tail`` once (the validation batches). Each env's steps run one after another, in one
    thread at a time, so its results do not depend on which thread ran them. Each worker
    runs its ops on :func:`threads_per_worker` intra-op threads (the cores torch uses,
    shared out: with fewer envs than cores, an env's ops get the spare ones); the calling
    thread's count is 1 while the workers run and is restored after. The first exception
    raised by a step, a finish, ``batches`` or ``tail`` is raised after every worker has
    stopped.
    """
    if finish_seconds is not None and len(finish_seconds) != n_envs:
        raise ValueError(
            f"finish_seconds holds {len(finish_seconds)} entries for {n_envs} envs; give one "
            "per env (None where unknown)"
        )
    plan: _Schedule[T, V, R] = _Schedule(n_envs, _known_length(batches), finish_seconds)
    cond = plan.cond
    per_worker = threads_per_worker(workers)

    def work() -> None:
        torch.set_num_threads(per_worker)  # each thread keeps its own intra-op count
        with counting_in_this_thread():  # host-read counters see this thread's reads too
            _work()

    def _work() -> None:
        try:
            while True:
                with cond:
                    task = plan.take()
                    if task is None:
                        return
                    env, b = task
                    batch = plan.drawn[b] if b is not None else None
                    tail_value = plan.tail
                if b is not None:
                    tick = time.perf_counter()
                    step(env, b, batch)  # type: ignore[arg-type]
                    seconds = time.perf_counter() - tick
                    with cond:
                        plan.stepped(env, seconds)
                else:
                    result = finish(env, tail_value)  # type: ignore[arg-type]
                    with cond:
                        plan.results[env] = result
                        plan.unfinished -= 1
                        cond.notify_all()
        except BaseException as exc:  # re-raised by the calling thread
            with cond:
                plan.fail(exc)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    started: list[threading.Thread] = []
    with intra_op_threads(1), _ctrl_c_stops(plan):
        try:
            for thread in threads:
                thread.start()
                started.append(thread)
            for batch in batches:
                with cond:
                    if plan.error is not None:
                        break
                    plan.drawn.append(batch)
                    cond.notify_all()
            else:
                value = tail()
                with cond:
                    plan.tail = value
                    plan.all_drawn = True
                    cond.notify_all()
        except BaseException as exc:
            with cond:
                plan.fail(exc)
        finally:
            for thread in started:
                thread.join()
    if plan.error is not None:
        raise plan.error
    return plan.results  # type: ignore[return-value]


@contextmanager
def _ctrl_c_stops(plan: _Schedule[Any, Any, Any]) -> Iterator[None]:
    """While the workers run, Ctrl-C stops the schedule instead of raising where it lands.

    A KeyboardInterrupt raised in the calling thread could leave a worker running past
    the interpreter's shutdown, which then aborts the process (``terminate called without
    an active exception``, SIGABRT): raised inside ``Thread.start``, before the new thread
    is joinable, or inside ``Thread.join``, whose interrupted wait (CPython 3.11) can mark
    a running thread stopped so that nothing waits for it. ``esper fit`` under Ctrl-C
    aborted so with a worker still in its SGD step or backward at shutdown, in about 1 of
    5 tries, while it joined through interrupts. So SIGINT's handler here only records the
    interrupt as the schedule's error: each worker finishes the step it is in and takes no
    other, the calling thread joins them all, and :func:`run_env_steps` raises the
    KeyboardInterrupt. Only where Python's own handler is installed and in the main thread
    (where handlers run); a program's own SIGINT handler is left alone.
    """
    if not python_handles_sigint():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        with plan.cond:  # a re-entrant lock: safe where the interrupted code holds it
            plan.fail(KeyboardInterrupt())

    signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
