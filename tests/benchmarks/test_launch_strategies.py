"""``benchmarks/launch_strategies.py``: every way trains the same nets to the same weights,
and the graph ways say they need a GPU on a CPU."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.benchmarks.loading import load_benchmark

launch = load_benchmark("launch_strategies")


def rows_of(out: str) -> dict[str, list[str]]:
    rows = [line for line in out.splitlines() if line.startswith("| predecessor | 2 |")]
    return {
        cells[2]: cells for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    }


def test_on_a_cpu_each_way_trains_to_the_reference_weights_and_graphs_say_na(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch_strategies.py", "--device", "cpu", "--n-envs", "2", "--hosts"]
    argv += ["predecessor", "--steps", "2", "--warmup", "1", "--threads", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    launch.main()
    rows = rows_of(capsys.readouterr().out)
    assert list(rows) == list(launch.WAYS)
    assert rows["one_thread"][5] == "reference"
    for way in ("one_thread", "threads", "stacked"):
        assert float(rows[way][3]) > 0, rows[way]  # microseconds per host step
        assert rows[way][4] == "n/a"  # no busy share off CUDA
    for way in ("threads", "stacked"):
        assert float(rows[way][5]) < 1e-5, rows[way]  # the same training
    for way in launch.GRAPH_WAYS:
        assert rows[way][3].startswith("n/a"), rows[way]


def test_a_stacked_step_gives_each_net_the_gradient_of_its_own_loss() -> None:
    device = torch.device("cpu")
    nets = launch.fresh_nets("predecessor", 3, device)
    alone = launch.fresh_nets("predecessor", 3, device)
    (batch,) = launch.make_batches("predecessor", 3, 1, device)
    group = launch.Stacked(nets)
    group.step(*launch.stacked_views(batch, 3))
    group.write_back()
    for i, net in enumerate(alone):
        net.step(*launch.share(batch, i, 3))
    for net, own in zip(launch.weights(nets), launch.weights(alone), strict=True):
        assert launch.net_difference(net, own) < 1e-6


def test_a_way_that_fails_says_why_in_its_row_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("no batching rule")

    monkeypatch.setattr(launch, "stacked", broken)
    argv = ["launch_strategies.py", "--device", "cpu", "--n-envs", "2", "--hosts"]
    argv += ["predecessor", "--steps", "1", "--warmup", "1", "--ways", "threads", "stacked"]
    monkeypatch.setattr(sys, "argv", argv)
    launch.main()
    rows = rows_of(capsys.readouterr().out)
    assert list(rows) == ["one_thread", "threads", "stacked"]
    assert rows["stacked"][3] == "failed: RuntimeError: no batching rule"
    assert float(rows["threads"][3]) > 0
