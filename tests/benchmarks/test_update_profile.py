"""``benchmarks/update_profile.py``: a fit's update in seconds, and by phase."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from tests.benchmarks.loading import load_benchmark

update_profile = load_benchmark("update_profile")

#: Small enough for the suite: few images, two-epoch episodes.
SMALL = ["--data.n_train", "64", "--data.n_val", "32", "--model.episode_epochs", "2"]


def test_it_times_updates_and_phases_in_fits_of_the_side_by_side_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    fits: list[list[str]] = []
    real_run = update_profile.run_fit

    def remembering(arguments):  # type: ignore[no-untyped-def]
        fits.append(list(arguments))
        real_run(arguments)

    monkeypatch.setattr(update_profile, "run_fit", remembering)
    monkeypatch.chdir(tmp_path)
    argv = ["update_profile.py", "--n-envs", "2", "--updates", "2", "--repeats", "1", "--", *SMALL]
    monkeypatch.setattr(sys, "argv", argv)
    update_profile.main()
    assert sys.argv == argv  # handed back after each fit
    # An untimed warm-up, a timed pair (2 updates, then 1) and the phases' fit (no
    # profiled one without --top), on the side-by-side work with the arguments after --
    # last.
    assert [f[f.index("--trainer.max_epochs") + 1] for f in fits] == ["1", "2", "1", "2"]
    assert all(f[-len(SMALL) :] == SMALL for f in fits)
    out = capsys.readouterr().out
    assert "2 envs on cpu: " in out and "s an update (median of 1: " in out
    seconds = {
        line[:48].strip(): float(line[48:])
        for line in out.splitlines()
        if line[:48].strip() in {phase.strip() for phase in update_profile.PHASES}
    }
    assert len(seconds) == len(update_profile.PHASES)
    update, rollout = seconds["update (one PPO update)"], seconds["rollout"]
    assert update >= rollout >= seconds["host epochs (run_epoch)"] > 0
    assert seconds["PPO update"] > 0 and seconds["policy act"] > 0
    assert "cProfile" not in out
    # Every wrapped function is put back.
    for where in update_profile.PHASES.values():
        owner, name = update_profile._owner_and_name(where)
        assert not getattr(owner, name).__qualname__.endswith("timed")


def test_a_timed_phase_adds_its_wall_even_when_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class Owner:
        @staticmethod
        def work(fail: bool) -> str:
            time.sleep(0.01)
            if fail:
                raise ValueError("failed")
            return "done"

    monkeypatch.setattr(update_profile, "PHASES", {"work": "x:Owner.work"})
    monkeypatch.setattr(update_profile, "_owner_and_name", lambda where: (Owner, "work"))
    seconds = {"work": 0.0}
    original = Owner.__dict__["work"]
    with update_profile.timed_phases(seconds):
        assert Owner.work(False) == "done"
        with pytest.raises(ValueError, match="failed"):
            Owner.work(True)
    assert seconds["work"] >= 0.02
    assert Owner.__dict__["work"] is original


def test_cprofiles_top_lists_the_most_time_of_their_own_first() -> None:
    stats = SimpleNamespace(
        stats={
            ("/v/site-packages/torch/nn/modules/module.py", 1, "a"): (1, 1, 0.5, 2.0, {}),
            ("/x/src/esper/simic/ppo.py", 300, "ppo_update"): (1, 1, 0.9, 9.0, {}),
            ("~", 0, "<built-in method torch.conv2d>"): (1, 1, 0.1, 0.1, {}),
        }
    )
    top = update_profile.own_time(stats, 2)  # type: ignore[arg-type]
    assert top == [
        (0.9, "esper/simic/ppo.py:300(ppo_update)"),
        (0.5, "torch/nn/modules/module.py:1(a)"),
    ]
