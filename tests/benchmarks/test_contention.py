"""benchmarks/contention.py times the same training steps alone, in threads and in processes."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.loading import load_benchmark


def test_each_case_runs_every_loop_for_its_steps_and_reports_the_slowest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = load_benchmark("contention")
    init = bench.StepLoop.__init__
    calls: list[int] = []

    def remember_seed(self, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
        init(self, seed)
        self.seed = seed

    def seconds_as_seed(self, n: int) -> float:  # type: ignore[no-untyped-def]
        calls.append(n)  # (in this process; a forked loop's call is seen by its result)
        return float(self.seed)  # each loop "takes" its seed: the slowest is known

    monkeypatch.setattr(bench.StepLoop, "__init__", remember_seed)
    monkeypatch.setattr(bench.StepLoop, "__call__", seconds_as_seed)
    assert bench.alone(5) == 0.0 and calls == [5]
    calls.clear()
    assert bench.in_threads(5, count=3) == 2.0 and calls == [5, 5, 5]
    assert bench.in_processes(5, count=3) == 2.0  # the max of what each process sent


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
