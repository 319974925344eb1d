"""CPU worker threads for host training: envs of one epoch train at the same time.

On a CPU, each env's convolutions are too small to keep two intra-op threads busy, and
envs used to train one after another, so every core but one sat mostly idle. Torch ops
release the GIL while they compute, so one Python thread per group of envs keeps every
core busy; each runs its ops on one intra-op thread, so the threads do not oversubscribe
the cores. (Processes would need the hosts, their optimizers and the batches to cross
process boundaries every epoch; threads share them.)

An env is owned by exactly one worker for the whole epoch and shares no tensor it writes
and no random stream with another env, so its figures do not depend on how threads are
scheduled: the results equal the sequential path's bit for bit, as long as both run each
op on the same number of intra-op threads (``tests/tolaria/test_parallel.py``).

The calling thread draws the loader's batches once and hands every worker each batch as
it is drawn (one unbounded queue per worker): collation of the next batch then overlaps
the workers' training, and at most one epoch of batches is ever queued, which the loader
already holds in memory for an in-memory dataset.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

#: Marks the end of a worker's stream.
_END = object()


def resolve_workers(requested: int | None, n_envs: int) -> int:
    """How many workers train ``n_envs`` envs: ``requested``, or (None) every core torch
    uses for intra-op work (its default is the physical cores, and ``OMP_NUM_THREADS``
    or ``torch.set_num_threads`` lower it), never more than there are envs."""
    wanted = torch.get_num_threads() if requested is None else requested
    return max(1, min(wanted, n_envs))


def env_groups(n_envs: int, workers: int) -> list[range]:
    """Contiguous, near-equal groups of env indices, one per worker."""
    return [range(k * n_envs // workers, (k + 1) * n_envs // workers) for k in range(workers)]


class _Worker(threading.Thread, Generic[T, R]):
    """Runs one task on the items its queue receives, single-threaded per op."""

    def __init__(self, task: Callable[[Iterator[T]], R]) -> None:
        super().__init__(daemon=True)
        self.task = task
        self.inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.result: R | None = None
        self.error: BaseException | None = None

    def stream(self) -> Iterator[T]:
        while (item := self.inbox.get()) is not _END:
            yield item  # type: ignore[misc]

    def run(self) -> None:
        # Each thread keeps its own intra-op thread count (OpenMP's is per thread).
        torch.set_num_threads(1)
        stream = self.stream()
        try:
            self.result = self.task(stream)
        except BaseException as exc:  # re-raised by the calling thread
            self.error = exc
        for _ in stream:  # let the feeder's items go; nothing waits on them
            pass


def run_in_workers(tasks: Sequence[Callable[[Iterator[T]], R]], items: Iterable[T]) -> list[R]:
    """Run every task in its own thread on the same stream of ``items``; their results in
    task order.

    ``items`` is iterated once, by the calling thread, while the tasks run. The process's
    intra-op thread count is 1 while they run and is restored after. The first failing
    task's exception (in task order) is raised after every thread has finished, and so is
    an exception raised by ``items``.
    """
    workers = [_Worker(task) for task in tasks]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # new threads take their intra-op count from here
    try:
        for worker in workers:
            worker.start()
        try:
            for item in items:
                for worker in workers:
                    worker.inbox.put(item)
        finally:
            for worker in workers:
                worker.inbox.put(_END)
            for worker in workers:
                worker.join()
    finally:
        torch.set_num_threads(previous)
    for worker in workers:
        if worker.error is not None:
            raise worker.error
    return [worker.result for worker in workers]  # type: ignore[misc]
