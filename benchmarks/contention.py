"""How much slower one host's training step gets when another core trains one too.

Issue 16 asks two threads to take at most 0.6 of one thread's time. Part of what stands
between 0.5 and that is the machine's: two cores share caches and memory bandwidth, and
a training step of a small CNN moves much more data than it computes. This times the
same step loop (the predecessor's host, ``CNNHost((3, 32, 32), 10, channels=(8, 16, 32),
convs_per_stage=1)``, SGD with momentum, 16 images, each op on one intra-op thread):

- *alone*: one loop in this thread;
- *2 threads*: two loops at once in two threads, each on its own copy (the interpreter
  lock shared, as with ``EnvConfig.cpu_workers``);
- *2 processes*: the same two loops in two forked processes (no lock shared).

Each figure is the slowest loop's seconds, median over interleaved ``--repeats``; the
ratio to *alone* is what each step costs when both cores train, with no scheduling, no
validation and nothing else. Half of it is the best two workers can do on this machine.

Usage: ``python benchmarks/contention.py [--steps 300] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from esper.kasmina import CNNHost
from esper.threads import intra_op_threads

#: Steps before timing starts in each loop (allocator and oneDNN warm-up).
WARMUP_STEPS = 20
IMAGES_PER_STEP = 16


class StepLoop:
    """Training steps of a fresh predecessor host on one fixed batch."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = CNNHost((3, 32, 32), 10, channels=(8, 16, 32), convs_per_stage=1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(IMAGES_PER_STEP, 3, 32, 32)
        self.y = torch.randint(0, 10, (IMAGES_PER_STEP,))

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.optimizer.step()

    def __call__(self, n: int) -> float:
        """Seconds of ``n`` steps at one intra-op thread, after :data:`WARMUP_STEPS`."""
        torch.set_num_threads(1)
        for _ in range(WARMUP_STEPS):
            self.step()
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        return time.perf_counter() - start


def alone(steps: int) -> float:
    return StepLoop()(steps)


def in_threads(steps: int, count: int = 2) -> float:
    loops = [StepLoop(seed) for seed in range(count)]
    seconds: list[float] = []
    lock = threading.Lock()

    def work(run: Callable[[int], float]) -> None:
        took = run(steps)
        with lock:
            seconds.append(took)

    threads = [threading.Thread(target=work, args=(run,)) for run in loops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(seconds)


def _process(conn: Connection, seed: int, steps: int) -> None:
    conn.send(StepLoop(seed)(steps))
    conn.close()


def in_processes(steps: int, count: int = 2) -> float:
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
    procs = [
        ctx.Process(target=_process, args=(send, seed, steps))
        for seed, (_, send) in enumerate(pipes)
    ]
    for proc in procs:
        proc.start()
    seconds = [recv.recv() for recv, _ in pipes]
    for proc in procs:
        proc.join()
    return max(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = {"alone": alone, "2 threads": in_threads, "2 processes": in_processes}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with intra_op_threads(1):
        for r in range(args.repeats):
            order = list(cases) if r % 2 == 0 else list(cases)[::-1]
            for name in order:
                times[name].append(cases[name](args.steps))
    base = statistics.median(times["alone"])
    print(
        f"predecessor host, {IMAGES_PER_STEP} images, {args.steps} steps per loop, "
        f"{args.repeats} interleaved rounds; the slowest loop's seconds"
    )
    print(f"{'':>12} | {'median s':>8} | {'ms / step':>9} | {'/ alone':>7} | rounds")
    for name, values in times.items():
        median = statistics.median(values)
        rounds = " ".join(f"{v:.3f}" for v in values)
        print(
            f"{name:>12} | {median:>8.3f} | {median / args.steps * 1e3:>9.3f} | "
            f"{median / base:>7.3f} | {rounds}"
        )


if __name__ == "__main__":
    main()
