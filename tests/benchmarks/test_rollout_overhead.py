"""benchmarks/rollout_overhead.py's pure host compute is the host work training does."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from esper.contracts import BlendMode
from esper.kasmina import CNNHost, GrowingHost, OptimConfig
from esper.kasmina.lifecycle import GateSignals
from esper.simic.module import PPOModule
from esper.tolaria.data import DATAMODULES
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import HostTraining
from tests.benchmarks.loading import load_benchmark
from tests.kasmina.factories import FAST
from tests.trainers import quiet_trainer


def _load():  # type: ignore[no-untyped-def]
    return load_benchmark("rollout_overhead")


def _hosts(n: int) -> list[GrowingHost]:
    """``n`` hosts, one with a seed in TRAINING so the incubation pass runs too."""
    torch.manual_seed(0)
    first = CNNHost((1, 8, 8), n_classes=4, channels=(4, 8), lifecycle=FAST)
    hosts = [GrowingHost(copy.deepcopy(first), OptimConfig()) for _ in range(n)]
    hosts[1].germinate(hosts[1].slot_ids[1], "conv_light", BlendMode.LINEAR)
    assert hosts[1].advance(hosts[1].slot_ids[1], GateSignals())
    return hosts


@pytest.mark.parametrize("group", [None, 2], ids=["unpaired", "paired"])
def test_pure_host_compute_trains_each_env_on_the_share_run_epoch_gives_it(
    group: int | None,
) -> None:
    """Same batches, same shares, same steps: the hosts end bit-identical to run_epoch's."""
    bench = _load()
    g = torch.Generator().manual_seed(0)
    train = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,))) for _ in range(3)]
    val = [(torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 4, (6,)))]
    pure, trained = _hosts(4), _hosts(4)

    bench.pure_host_compute([pure], train, val, workers=1, group=group)
    run_epoch(trained, train, val, HostTraining(paired_group=group, cpu_workers=1))

    for p_host, r_host in zip(pure, trained, strict=True):
        mine = dict(p_host.model.named_parameters())
        for name, p in r_host.model.named_parameters():
            assert torch.equal(mine[name], p), name


def test_each_round_s_thread_ratio_pairs_fits_that_ran_side_by_side() -> None:
    """A machine that slows between rounds must not bend the per-thread ratio."""
    bench = _load()

    def rnd(wall: float, pure: float, ratio: float) -> dict[str, float]:
        return {
            "wall": wall,
            "host_epochs": wall - 0.5,
            "update": 0.1 * wall,
            "rest": 0.4 * wall,
            "run_epoch": wall - 1,
            "pure": pure,
            "ratio": ratio,
        }

    one = [rnd(w, w, 1.0) for w in (10.0, 20.0, 30.0)]
    two = [rnd(w, w - 2, r) for w, r in ((6.0, 1.2), (13.0, 1.1), (15.0, 1.3))]
    row = bench.summarise(two, one)
    assert (row["wall"], row["host_epochs"], row["run_epoch"], row["pure"], row["ratio"]) == (
        13.0,
        12.5,
        12.0,
        11.0,
        1.2,
    )
    assert row["update"] == pytest.approx(1.3)
    assert row["rest"] == pytest.approx(5.2)
    assert row["vs_first"] == pytest.approx(0.6)  # rounds 0.6, 0.65, 0.5; medians alone 0.65
    assert bench.summarise(one, one)["vs_first"] == 1.0


def test_overhead_rounds_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        _load().print_overhead([4], 8, 1, 1, rounds=0)


def test_the_figures_beside_each_epoch_leave_the_run_as_it_was() -> None:
    """Pure and run_epoch are timed on copies right before the epoch; the run's hosts and
    random streams come out as they went in, and both figures land in the current update."""
    bench = _load()
    data = DATAMODULES.get("synthetic")(
        input_shape=[1, 8, 8], n_classes=4, n_train=16, n_val=8, batch_size=8
    )
    timer = bench._UpdateTimer(warmup=0, data=data, workers=1, group=None)
    timer.pure.append(0.0)
    timer.run_epoch.append(0.0)
    hosts = _hosts(4)
    before = [copy.deepcopy(h.model.state_dict()) for h in hosts]
    rng = torch.random.get_rng_state()
    timed: dict[str, list[float]] = {"pure": [], "run_epoch": []}

    def recording(name: str, compute):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            timed[name].append(compute(*args, **kwargs))
            return timed[name][-1]

        return run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "pure_host_compute", recording("pure", bench.pure_host_compute))
        patch.setattr(bench, "run_epoch_compute", recording("run_epoch", bench.run_epoch_compute))
        timer._measure_copies(hosts, pure_first=True)
        timer._measure_copies(hosts, pure_first=False)

    assert torch.equal(torch.random.get_rng_state(), rng)
    for host, state in zip(hosts, before, strict=True):
        for name, value in host.model.state_dict().items():
            assert torch.equal(value, state[name]), name
    # Each figure is the sum of its two measurements, in the current update's slot.
    assert len(timed["pure"]) == len(timed["run_epoch"]) == 2
    assert timer.pure == [sum(timed["pure"])] and timer.run_epoch == [sum(timed["run_epoch"])]


def test_wall_over_pure_is_the_median_of_each_update_s_own_ratio() -> None:
    """A machine that drifts between updates must not bend wall / pure either."""
    timer = _load()._UpdateTimer(warmup=0, data=None, workers=2, group=4)
    timer.seconds, timer.pure, timer.run_epoch = [2.2, 4.4, 3.0], [2.0, 4.0, 2.0], [2.1, 4.1, 2.5]
    timer.host_epochs, timer.update = [2.0, 4.0, 2.6], [0.1, 0.2, 0.3]
    figures = timer.medians()
    assert (figures["wall"], figures["pure"], figures["run_epoch"]) == (3.0, 2.0, 2.5)
    assert (figures["host_epochs"], figures["update"]) == (2.6, 0.2)
    # Rests 0.1, 0.2, 0.1 (each update's own); medians taken apart give 3.0 - 2.6 - 0.2.
    assert figures["rest"] == pytest.approx(0.1)
    assert figures["ratio"] == pytest.approx(1.1)  # ratios 1.1, 1.1, 1.5; medians alone 1.5
    assert (figures["workers"], figures["group"]) == (2, 4)


def test_wall_only_times_the_updates_and_nothing_beside_them() -> None:
    """No copies are trained before its epochs, and it reports no pure or run_epoch."""
    bench = _load()
    timer = bench._WallTimer(warmup=0, data=None, workers=2, group=None)
    timer.pure.append(0.0)
    timer.run_epoch.append(0.0)
    timer._measure_copies(_hosts(2), pure_first=True)  # data=None: any copy would fail
    timer.seconds, timer.host_epochs, timer.update = [3.0], [2.5], [0.2]
    figures = timer.medians()
    assert (figures["wall"], figures["host_epochs"], figures["update"]) == (3.0, 2.5, 0.2)
    assert all(math.isnan(figures[key]) for key in ("pure", "run_epoch", "ratio"))


def tiny_fit(timer: L.Callback, root: Path, updates: int = 3) -> None:
    """A real ``Trainer.fit`` of a small PPOModule (4 envs, 3-epoch episodes) with ``timer``."""
    data = DATAMODULES.get("synthetic")(
        input_shape=[3, 8, 8], n_classes=4, n_train=64, n_val=32, batch_size=16
    )
    module = PPOModule(n_envs=4, episode_epochs=3, host_kwargs={"channels": [4, 8]})
    trainer = quiet_trainer(root, updates, callbacks=[timer])
    trainer.fit(module, datamodule=data)


def test_the_wall_s_split_is_timed_inside_each_update(tmp_path: Path) -> None:
    """In a real fit, each update's host epochs and PPO update are timed, inside its wall."""
    timer = _load()._WallTimer(warmup=1, data=None, workers=1, group=None)
    tiny_fit(timer, tmp_path)

    assert len(timer.seconds) == len(timer.host_epochs) == len(timer.update) == 2  # 1 warm-up
    for wall, epochs, update in zip(timer.seconds, timer.host_epochs, timer.update, strict=True):
        assert epochs > 0.0 and update > 0.0
        assert epochs + update < wall
