"""Threads or processes for host training (issue 16, "whichever measures faster"): the pure
host compute of the same recorded hosts, one after another, in threads and in processes.

One ``Trainer.fit`` of issue 16's work (``benchmarks/rollout_overhead.py``: synthetic
3x32x32, 16 images per env per step, default callbacks) records every env's host (model
and optimizers) before each host epoch of the timed updates. Then, interleaved over
``--repeats`` rounds, copies of those hosts train on the same pre-collated batches, with
the pure compute of ``rollout_overhead`` (forward, loss, incubation pass, backward,
optimiser steps, then a plain validation forward), each op on one intra-op thread:

- *sequential*: every env one after another in this thread (``torch.set_num_threads(1)``);
- *threads, step at a time*: ``run_env_steps`` in ``--workers`` threads, as training runs;
- *threads, fixed split*: env ``i`` trains in thread ``i mod workers``, whole epochs;
- *processes, fixed split*: the same split in ``--workers`` forked processes. Each records
  its epochs' seconds, and the figure is the sum over epochs of the slowest process's
  epoch, as if the processes met at every epoch's end (which training needs: the policy
  acts on all envs at once); the processes' start is not in it.

The two fixed splits differ only in threads against processes (one interpreter lock
against one each). What processes would pay on top, *moving the hosts*, is timed too:
``pickle`` of an epoch's hosts and back, in this process, once each way per epoch (hosts
that stay in their process would send less, and more bookkeeping).

Usage: ``python benchmarks/workers.py [--hosts predecessor] [--n-envs 4] [--updates 2]
[--repeats 3] [--workers 2]``
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import pickle
import statistics
import threading
import time
from multiprocessing.connection import Connection

import torch
from rollout_overhead import (
    HOSTS,
    Batch,
    _UpdateTimer,
    fit_case,
    pure_host_compute,
    train_share,
)

from esper.cli.options import quiet_third_party
from esper.kasmina import GrowingHost
from esper.threads import intra_op_threads

Epoch = list[GrowingHost]


class _Recorder(_UpdateTimer):
    """Keeps a copy of every env's host before each host epoch of the timed updates."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.epochs: list[Epoch] = []

    def _measure_copies(self, hosts: list[GrowingHost], pure_first: bool) -> None:
        self.batches()
        self.epochs.append(copy.deepcopy(hosts))


def _split(n_envs: int, workers: int) -> list[list[int]]:
    return [list(range(w, n_envs, workers)) for w in range(workers)]


def threads_fixed_split(
    epochs: list[Epoch], train: list[Batch], val: list[Batch], group: int | None, workers: int
) -> float:
    """Seconds for every epoch with env ``i`` in thread ``i mod workers``, meeting at each
    epoch's end."""
    total = 0.0
    with intra_op_threads(1):
        for hosts in epochs:

            def work(envs: list[int], hosts: Epoch = hosts) -> None:
                torch.set_num_threads(1)
                train_share(hosts, envs, train, val, group)

            threads = [
                threading.Thread(target=work, args=(envs,)) for envs in _split(len(hosts), workers)
            ]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            total += time.perf_counter() - start
    return total


def _process_share(
    conn: Connection,
    epochs: list[Epoch],
    envs: list[int],
    train: list[Batch],
    val: list[Batch],
    group: int | None,
    send_hosts: bool,
) -> None:
    torch.set_num_threads(1)
    seconds = []
    for hosts in epochs:
        start = time.perf_counter()
        train_share(hosts, envs, train, val, group)
        seconds.append(time.perf_counter() - start)
    trained = [[hosts[i].model.state_dict() for i in envs] for hosts in epochs]
    # Plain pickle: tensors by value (torch's reductions would hand over file descriptors
    # of shared memory that this process takes with it when it exits).
    conn.send_bytes(pickle.dumps((seconds, trained if send_hosts else None)))
    conn.close()


def processes_fixed_split(
    epochs: list[Epoch],
    train: list[Batch],
    val: list[Batch],
    group: int | None,
    workers: int,
    send_hosts: bool = False,
) -> tuple[float, list[list[dict[str, torch.Tensor]]] | None]:
    """Sum over epochs of the slowest forked process's epoch, env ``i`` in process
    ``i mod workers``; with ``send_hosts`` also each epoch's trained model states, in env
    order (what the test compares)."""
    context = mp.get_context("fork")
    splits = _split(len(epochs[0]), workers)
    pipes, processes = [], []
    for envs in splits:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_process_share, args=(send, epochs, envs, train, val, group, send_hosts)
        )
        process.start()
        pipes.append(receive)
        processes.append(process)
    results = [pickle.loads(pipe.recv_bytes()) for pipe in pipes]
    for process in processes:
        process.join()
    total = sum(max(per_epoch) for per_epoch in zip(*(r[0] for r in results), strict=True))
    if not send_hosts:
        return total, None
    states: list[list[dict[str, torch.Tensor]]] = [[{}] * len(epochs[0]) for _ in epochs]
    for envs, (_, trained) in zip(splits, results, strict=True):
        for e, epoch_states in enumerate(trained):
            for i, state in zip(envs, epoch_states, strict=True):
                states[e][i] = state
    return total, states


def moving_hosts(epochs: list[Epoch]) -> float:
    """Seconds to pickle every epoch's hosts and unpickle them, twice (there and back)."""
    start = time.perf_counter()
    for hosts in epochs:
        for _ in range(2):
            pickle.loads(pickle.dumps(hosts))
    return time.perf_counter() - start


def measure(host: str, n_envs: int, updates: int, repeats: int, workers: int) -> None:
    recorder = fit_case(host, n_envs, 8, updates, 1, 0, workers, timer_class=_Recorder)
    assert isinstance(recorder, _Recorder)
    epochs, group = recorder.epochs, recorder.group
    train, val = recorder.batches()
    figures: dict[str, list[float]] = {
        k: []
        for k in (
            "sequential",
            "threads, step at a time",
            "threads, fixed split",
            "processes, fixed split",
            "moving the hosts",
        )
    }
    for _ in range(repeats):
        with intra_op_threads(1):
            sequential = pure_host_compute(copy.deepcopy(epochs), train, val, 1, group)
        figures["sequential"].append(sequential)
        figures["threads, step at a time"].append(
            pure_host_compute(copy.deepcopy(epochs), train, val, workers, group)
        )
        figures["threads, fixed split"].append(
            threads_fixed_split(copy.deepcopy(epochs), train, val, group, workers)
        )
        figures["processes, fixed split"].append(
            processes_fixed_split(copy.deepcopy(epochs), train, val, group, workers)[0]
        )
        figures["moving the hosts"].append(moving_hosts(epochs))
    per_update = len(epochs) // updates
    print(
        f"{host} host, {n_envs} envs, {updates} updates ({len(epochs)} host epochs, "
        f"{per_update} per update), {workers} workers, {repeats} rounds; seconds per update"
    )
    print(f"{'':>24} | {'median s':>8} | {'rounds':>24} | {'/ sequential':>12}")
    for name, values in figures.items():
        ratio = statistics.median(v / s for v, s in zip(values, figures["sequential"], strict=True))
        print(
            f"{name:>24} | {statistics.median(values) / updates:>8.3f} | "
            f"{' '.join(f'{v / updates:.3f}' for v in values):>24} | {ratio:>12.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", nargs="+", default=["predecessor"], choices=list(HOSTS))
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4])
    parser.add_argument("--updates", type=int, default=2, help="timed updates recorded")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--workers", type=int, default=2, help="threads or processes")
    args = parser.parse_args()
    if args.workers < 2:
        parser.error(
            f"--workers must be >= 2 to compare threads with processes, got {args.workers}"
        )
    quiet_third_party()
    for host in args.hosts:
        for n in args.n_envs:
            measure(host, n, args.updates, args.repeats, args.workers)


if __name__ == "__main__":
    main()
