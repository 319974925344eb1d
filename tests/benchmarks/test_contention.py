"""benchmarks/contention.py times the same training steps alone, in threads and in processes."""

from __future__ import annotations

import torch

from tests.benchmarks.loading import load_benchmark


def test_every_case_times_its_loops_and_the_loops_train() -> None:
    bench = load_benchmark("contention")
    previous = torch.get_num_threads()
    try:
        for case in (bench.alone, bench.in_threads, bench.in_processes):
            assert case(2) > 0.0
    finally:
        torch.set_num_threads(previous)


def test_a_loop_trains_its_host() -> None:
    """The timed steps are real training steps: the loss on the loop's batch falls."""
    bench = load_benchmark("contention")
    previous = torch.get_num_threads()
    try:
        loop = bench.StepLoop(seed=3)

        def loss() -> float:
            with torch.no_grad():
                return float(torch.nn.functional.cross_entropy(loop.model(loop.x), loop.y))

        before = loss()
        loop(5)
        assert loss() < before
    finally:
        torch.set_num_threads(previous)
