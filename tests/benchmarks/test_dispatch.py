"""``benchmarks/dispatch.py``: a figure per engine and env count, from timed epochs."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

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


def test_grown_hosts_differ_as_a_fit_makes_them_and_still_stack(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = count_stacked_steps(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["dispatch.py", "--n-envs", "4", "--steps", "2", "--grown"])
    dispatch.main()
    out = capsys.readouterr().out
    assert "hosts grown apart" in out
    assert [line for line in out.splitlines() if line.startswith("| 4 |")]
    assert steps == [4] * (2 + 2)  # every grown env in one group, every step
    envs = [dispatch.GrowingHost(dispatch.CNNHost(lifecycle=dispatch.QUICK)) for _ in range(8)]
    dispatch.grown_apart(envs)
    stages = {slot.stage for env in envs for slot in env.model.iter_slots()}
    assert len(stages) >= 4  # the drawn stages are reached, not left where planted


def test_ops_counts_what_would_launch_a_kernel_per_env_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    counter = dispatch.KernelOps()
    x = torch.randn(4, 3)
    with counter:
        x.view(-1)  # a view: no kernel
        torch.where(x > 0, x, 0.0)  # the wrapped 0.0 is no kernel; the compare and where are
        torch._foreach_add_([x, x.clone()], 1.0)  # a clone, and one multi-tensor op
    assert counter.counts == {"gt": 1, "where": 1, "clone": 1, "_foreach_add_": 1}
    counter = dispatch.KernelOps()
    empty, two = torch.zeros(0), torch.zeros(2)
    with counter:
        copy.deepcopy(empty)  # a deepcopy's set_, and a copy of nothing
        copy.deepcopy(two)  # one copy: its values
        empty.add_(1.0)  # empty output: torch launches nothing
    assert counter.counts == {"copy_": 1}
    argv = ["dispatch.py", "--n-envs", "4", "--steps", "8", "--ops"]
    monkeypatch.setattr(sys, "argv", argv)
    dispatch.main()
    out = capsys.readouterr().out
    assert "kernel ops / env step" in out
    _, ops = [line for line in out.splitlines() if line.startswith("| 4 |")]
    per_env, stacked = (float(cell) for cell in ops.strip("|").split("|")[1:])
    assert per_env > stacked > 0  # four envs alike: one stacked step trains them all


def test_images_sets_how_many_images_each_env_trains_on_a_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[int] = []
    real = dispatch.run_epoch

    def recording(envs, train, val, training):  # type: ignore[no-untyped-def]
        seen.extend(x.shape[0] for x, _ in train)
        return real(envs, train, val, training)

    monkeypatch.setattr(dispatch, "run_epoch", recording)
    argv = ["dispatch.py", "--n-envs", "2", "--steps", "2", "--images", "5"]
    monkeypatch.setattr(sys, "argv", argv)
    dispatch.main()
    assert "2 steps of 5 (3, 8, 8) image(s) per env" in capsys.readouterr().out
    assert seen and set(seen) == {2 * 5}  # each batch: 5 images for each of the 2 envs
