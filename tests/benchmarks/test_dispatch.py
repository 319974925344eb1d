"""``benchmarks/dispatch.py``: a figure per engine and env count, from timed epochs."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark
from tests.tolaria.stacking import count_stacked_steps

dispatch = load_benchmark("dispatch")


def test_it_prints_each_engines_cost_per_env_step_and_their_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = count_stacked_steps(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["dispatch.py", "--n-envs", "2", "--steps", "3"])
    dispatch.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1, rows
    per_env, stacked, ratio = (cell.strip() for cell in rows[0].strip("|").split("|")[1:])
    assert float(per_env) > 0 and float(stacked) > 0
    assert float(ratio.rstrip("x")) == pytest.approx(float(per_env) / float(stacked), rel=0.02)
    assert steps == [2] * (3 + 3)  # warm-up and timed epoch: every step stacked
