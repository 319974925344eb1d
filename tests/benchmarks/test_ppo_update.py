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


def test_recorded_paths_count_what_a_recording_leaves_to_launch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--recorded --tape``: each path again with its minibatches recorded on the tests'
    tape, one recording over the updates of a run; what is left to launch is a fraction
    of the eager update's operators (a replay counted as one)."""
    argv = ["ppo_update.py", "--n-envs", "2", "--episode-epochs", "3", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--recorded", "--tape"])
    ppo_update.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    ops = {row.split("|")[3].strip(): int(row.split("|")[5]) for row in rows}
    assert list(ops) == [
        "one call",
        "one call, recorded",
        "one call, restores",
        "one call, restores, recorded",
        "step loop",
        "step loop, recorded",
    ]
    for path in ("one call", "one call, restores", "step loop"):
        assert 0 < ops[f"{path}, recorded"] < ops[path] / 4, (path, ops)


def test_recorded_without_a_recorder_says_to_add_the_tape(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["ppo_update.py", "--recorded"])
    with pytest.raises(SystemExit):
        ppo_update.main()
    assert "add --tape" in capsys.readouterr().err
