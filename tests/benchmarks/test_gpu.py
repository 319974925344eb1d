"""``benchmarks/gpu.py``: its busy share counts overlapping kernels once; it runs on a CPU."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark
from tests.tolaria.stacking import count_stacked_steps

gpu = load_benchmark("gpu")


def test_covered_time_is_the_union_of_the_kernel_intervals() -> None:
    assert gpu.covered([]) == 0.0
    assert gpu.covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # overlap once
    assert gpu.covered([(0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested
    assert gpu.covered([(4.0, 5.0), (0.0, 1.0)]) == 2.0  # any order


def test_on_a_cpu_it_prints_steps_per_second_per_engine_and_no_busy_share(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gpu.py", "--device", "cpu", "--n-envs", "2", "--epochs", "1"]
    argv += ["--train-images", "32", "--hosts", "predecessor"]
    monkeypatch.setattr(sys, "argv", argv)
    gpu.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| pred")]
    assert [row.split("|")[3].strip() for row in rows] == ["per_env", "stacked"], rows
    # Each row is also printed whole as it ends (a cut-short device call keeps it).
    assert [line for line in lines if line.startswith("  done: ")] == [f"  done: {r}" for r in rows]
    for row in rows:
        assert row.endswith("| n/a | n/a |"), row  # no busy share, no device events
        assert float(row.split("|")[4]) > 0  # host steps/s


def test_grown_hosts_train_stacked_in_one_group_and_say_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = count_stacked_steps(monkeypatch)
    argv = ["gpu.py", "--device", "cpu", "--n-envs", "4", "--epochs", "1", "--grown"]
    argv += ["--train-images", "32", "--hosts", "predecessor", "--engines", "stacked"]
    monkeypatch.setattr(sys, "argv", argv)
    gpu.main()
    out = capsys.readouterr().out
    assert "hosts grown apart" in out
    assert [line for line in out.splitlines() if line.startswith("| predecessor | 4 | stacked")]
    assert steps and set(steps) == {4}  # the grown envs train as one group


def test_recorded_steps_are_a_cuda_engine_and_refused_on_a_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row named for CUDA graphs must time CUDA graphs: on a CPU nothing records, so
    the engine is refused there rather than timing the unrecorded step under its name."""
    assert gpu.host_training("stacked_graphs").cuda_graphs
    assert not gpu.host_training("stacked").cuda_graphs
    argv = ["gpu.py", "--device", "cpu", "--engines", "stacked_graphs"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        gpu.main()
    assert "needs --device cuda" in capsys.readouterr().err
