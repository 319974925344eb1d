"""``benchmarks/timeline.py`` runs and prints each figure it names."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark


def test_the_timeline_benchmark_prints_in_line_handed_over_and_helper_times(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("timeline")
    argv = ["timeline.py", "--pictures", "1", "--n-envs", "2", "--episode-epochs", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = capsys.readouterr().out
    for figure in ("in line", "handed over", "pickled by the writer thread", "helper, per picture"):
        assert figure in out, out
