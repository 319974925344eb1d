"""``benchmarks/update_profile.py``: a fit's update in seconds, and by phase."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests.benchmarks.loading import load_benchmark

update_profile = load_benchmark("update_profile")

#: Small enough for the suite: few images, two-epoch episodes.
SMALL = ["--data.n_train", "32", "--data.n_val", "16", "--model.episode_epochs", "2"]


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
    argv = ["update_profile.py", "--n-envs", "2", "--updates", "2", "--repeats", "1"]
    ours = [*argv, "--", *SMALL]
    monkeypatch.setattr(sys, "argv", ours)
    update_profile.main()
    assert sys.argv == ours  # handed back after each fit
    # An untimed warm-up, the phases' fit, then a timed pair (2 updates, then 1): no
    # counted, traced or profiled one without --counts, --trace or --top; on the
    # side-by-side work with the arguments after -- last.
    epochs = [f[f.index("--trainer.max_epochs") + 1] for f in fits]
    assert epochs == ["1", "2", "2", "1"]
    assert all(f[-len(SMALL) :] == SMALL for f in fits)
    out = capsys.readouterr().out
    assert "2 envs on cpu: " in out and "s an update unprofiled (median of 1: " in out
    phases = {phase.strip() for phase in update_profile.PHASES}
    assert "counted per update" not in out and "torch.profiler" not in out
    seconds = {
        line[:48].strip(): float(line[48:])
        for line in out.splitlines()
        if line[:48].strip() in phases
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


def test_esper_time_lists_esper_s_functions_by_time_inside_them_first() -> None:
    stats = SimpleNamespace(
        stats={
            ("/v/site-packages/torch/nn/modules/module.py", 1, "a"): (1, 1, 0.5, 20.0, {}),
            ("/x/src/esper/simic/ppo.py", 300, "ppo_update"): (1, 1, 0.9, 9.0, {}),
            ("/x/src/esper/tolaria/snapshot.py", 46, "take"): (1, 1, 0.1, 3.0, {}),
            ("/x/src/esper/cli/__init__.py", 41, "fit"): (1, 1, 0.0, 30.0, {}),
        }
    )
    top = update_profile.esper_time(stats, 2)  # type: ignore[arg-type]
    assert top == [
        (9.0, "esper/simic/ppo.py:300(ppo_update)"),
        (3.0, "esper/tolaria/snapshot.py:46(take)"),
    ]


def test_a_phase_tally_counts_kernels_reads_and_copies_under_every_running_phase() -> None:
    running: list[str] = []
    x = torch.arange(4.0)
    with update_profile.PhaseTally(running) as tally:
        x + 1  # outside every phase: the fit's total only
        running.append("outer")
        x * 2
        running.append("inner")
        (x - 1).sum().item()  # two kernels and a read of a host tensor: no wait
        x.view(2, 2)  # a view launches nothing
        running.pop()
        running.pop()
    assert tally.row("inner") == [2, 1, 0, 0, 0]
    assert tally.row("outer") == [3, 1, 0, 0, 0]
    assert tally.row(update_profile.OUTSIDE) == [4, 1, 0, 0, 0]


def test_copies_are_told_apart_by_direction() -> None:
    def on(kind: str) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(kind))

    moved = update_profile._moved
    # _to_copy(input) -> out
    assert moved("_to_copy", (on("cpu"),), on("cuda")) == "to device"
    assert moved("_to_copy", (on("cuda"),), on("cpu")) == "to host"
    assert moved("_to_copy", (on("cpu"),), on("cpu")) is None  # a dtype change
    # copy_(target, source)
    assert moved("copy_", (on("cpu"), on("cuda")), None) == "to host"
    assert moved("copy_", (on("cuda"), on("cpu")), None) == "to device"
    assert moved("copy_", (on("cuda"), on("meta")), None) is None  # neither is the host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_phase_tally_counts_device_waits_and_both_directions_of_copy() -> None:
    running = ["phase"]
    host = torch.ones(4)  # made outside: filling it is an operator of its own (on the host)
    with update_profile.PhaseTally(running) as tally:
        t = host.to("cuda")
        t.sum().item()
        t.cpu()
        torch.empty(4).copy_(t)
    ops, reads, waits, to_device, to_host = tally.row("phase")
    assert (reads, waits, to_device, to_host) == (1, 1, 1, 2)
    assert ops == 1  # the sum


def test_traced_events_rank_by_cpu_time_of_their_own() -> None:
    events = [
        SimpleNamespace(key="aten::add", count=4, self_cpu_time_total=30.0),
        SimpleNamespace(key="cudaLaunchKernel", count=9, self_cpu_time_total=90.0),
        SimpleNamespace(key="aten::mul", count=1, self_cpu_time_total=10.0),
    ]
    assert update_profile.traced_events(events, 2) == [
        (90.0, 9, "cudaLaunchKernel"),
        (30.0, 4, "aten::add"),
    ]


class _Fit:
    """Stands in for ``esper fit`` where a test needs a fit's phases, not a real fit: each
    update runs a phase that runs a nested phase and reads a value on the host."""

    @staticmethod
    def update() -> None:
        x = torch.arange(8.0)
        _Fit.inner(x)
        (x * 2).sum().item()

    @staticmethod
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_counts_and_trace_print_each_phases_operators_and_the_top_events(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    phases = {"update": f"{__name__}:_Fit.update", "  inner": f"{__name__}:_Fit.inner"}
    monkeypatch.setattr(update_profile, "PHASES", phases)

    def fit(arguments: list[str]) -> None:
        for _ in range(int(arguments[arguments.index("--trainer.max_epochs") + 1])):
            _Fit.update()

    monkeypatch.setattr(update_profile, "run_fit", fit)
    argv = ["update_profile.py", "--updates", "2", "--repeats", "1", "--counts", "--trace", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    update_profile.main()
    out = capsys.readouterr().out
    counted = out.split("counted per update")[1].split("\n\n")[0]
    rows = {line[:48].strip(): line[48:].split() for line in counted.splitlines()[2:]}
    # Per update: inner's add; update's arange, that add, mul, sum and one read of a host
    # tensor (no wait: it is not a device's).
    assert rows["inner"] == ["1", "0", "0", "0", "0"]
    assert rows["update"] == ["4", "1", "0", "0", "0"]
    assert rows[update_profile.OUTSIDE] == ["4", "1", "0", "0", "0"]
    traced = out.split("under torch.profiler")[1].split("event\n")[1].split("\n\n")[0]
    assert len(traced.splitlines()) == 2  # the top 2: milliseconds, calls, event
    assert all(row.split()[2].startswith("aten::") for row in traced.splitlines())
