"""``benchmarks/ppo_update.py``: seconds and kernel ops of one PPO update, per replay path."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark

ppo_update = load_benchmark("ppo_update")


def test_it_times_both_replay_paths_on_one_collected_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    replays: list[bool] = []
    real_update = ppo_update.ppo_update

    def remembering(policy, optimizer, batch, config):  # type: ignore[no-untyped-def]
        replays.append(batch.unbroken)
        return real_update(policy, optimizer, batch, config)

    monkeypatch.setattr(ppo_update, "ppo_update", remembering)
    argv = ["ppo_update.py", "--n-envs", "2", "--episode-epochs", "3", "--repeats", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    ppo_update.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["fused", "step loop"]
    # Per path: a warm-up, the timed repeats and the counted update, on its own flag.
    assert replays == [True] * 4 + [False] * 4
    fused, stepped = (row.strip("|").split("|") for row in rows)
    assert float(fused[3]) > 0 and float(stepped[3]) > 0
    assert 0 < int(fused[4]) < int(stepped[4])  # the loop launches more, the figure says so
