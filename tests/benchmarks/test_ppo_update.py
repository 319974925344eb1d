"""``benchmarks/ppo_update.py``: seconds and kernel ops of one PPO update, per replay path."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark

ppo_update = load_benchmark("ppo_update")


def test_it_times_every_replay_path_on_one_collected_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    replays: list[object] = []
    real_update = ppo_update.ppo_update

    def remembering(policy, optimizer, batch, config):  # type: ignore[no-untyped-def]
        replays.append(batch.breaks)
        return real_update(policy, optimizer, batch, config)

    monkeypatch.setattr(ppo_update, "ppo_update", remembering)
    argv = ["ppo_update.py", "--n-envs", "2", "--episode-epochs", "3", "--repeats", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    ppo_update.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    paths = ["one call", "one call, restores", "step loop"]
    assert [row.split("|")[3].strip() for row in rows] == paths
    # Per path: a warm-up, the timed repeats and the counted update, on its own batch:
    # the rollout's breaks (none: no governor), a restore's in env 0, none listed.
    steps = int(rows[0].split("|")[2])
    cut = tuple(t for t in (steps // 2, steps // 2 + 1) if t < steps)
    want = [((), ()), (cut, ()), None]
    assert replays == [b for b in want for _ in range(4)]
    fused, restored, stepped = (row.strip("|").split("|") for row in rows)
    assert all(float(row[3]) > 0 for row in (fused, restored, stepped))
    # The loop launches more, the figures say so; the restores cost a few ops a minibatch.
    assert 0 < int(fused[4]) < int(restored[4]) < int(stepped[4])
