"""``benchmarks/update_profile.py``: a fit's update by phase, from a profile of that fit."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tests.benchmarks.loading import load_benchmark

update_profile = load_benchmark("update_profile")

#: Small enough for the suite: few images, two-epoch episodes.
SMALL = ["--data.n_train", "64", "--data.n_val", "32", "--model.episode_epochs", "2"]


def test_it_profiles_the_second_fit_and_prints_nested_phases_per_update(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    fits: list[list[str]] = []
    real_run = update_profile.run_fit

    def remembering(arguments):  # type: ignore[no-untyped-def]
        fits.append(list(arguments))
        real_run(arguments)

    monkeypatch.setattr(update_profile, "run_fit", remembering)
    monkeypatch.chdir(tmp_path)
    argv = ["update_profile.py", "--n-envs", "2", "--updates", "2", "--top", "3", "--", *SMALL]
    monkeypatch.setattr(sys, "argv", argv)
    update_profile.main()
    assert sys.argv == argv  # handed back after each fit
    # An unprofiled fit of one update, then the profiled one of --updates, both on the
    # side-by-side work with the arguments after -- last (so they win).
    assert [f[f.index("--trainer.max_epochs") + 1] for f in fits] == ["1", "2"]
    assert all(f[-len(SMALL) :] == SMALL for f in fits)
    out = capsys.readouterr().out
    seconds = {
        line[:48].strip(): float(line[48:])
        for line in out.splitlines()
        if line[:48].strip() in {phase.strip() for phase in update_profile.PHASES}
    }
    assert (
        seconds["update (training_step)"]
        >= seconds["rollout"]
        >= seconds["host epochs (run_epoch)"]
        > 0
    )
    assert seconds["PPO update"] > 0 and seconds["policy act"] > 0
    assert "2 envs on cpu, 2 profiled update(s)" in out
    assert len(out.split("most time of their own (s / update):")[1].strip().splitlines()) == 3


def test_a_phase_counts_every_function_of_its_name_in_its_file() -> None:
    stats = SimpleNamespace(
        stats={
            ("/x/src/esper/simic/ppo.py", 300, "ppo_update"): (1, 1, 0.5, 2.0, {}),
            ("/y/esper/simic/ppo.py", 10, "ppo_update"): (1, 1, 0.1, 1.0, {}),  # a second copy
            ("/x/src/esper/simic/other.py", 1, "ppo_update"): (1, 1, 9.0, 9.0, {}),
        }
    )

    found = update_profile.phase_seconds(stats)  # type: ignore[arg-type]
    assert found["  PPO update"] == 3.0
    assert found["checkpoint save"] == 0.0
