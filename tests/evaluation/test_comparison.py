"""Growers against the controls: each control builds the network it names, on paired
episodes, and every row's error bar counts an episode group once."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import SeedStage
from esper.contracts.evaluation import REPORTING_SEEDS, TUNING_SEEDS
from esper.evaluation.comparison import Evaluation, compare
from esper.evaluation.episodes import GROUPS_PER_SEED, group_key
from esper.kasmina import CNNHost, GrowingHost
from esper.kasmina.sizing import DEFAULT_TOLERANCE
from esper.mdp.env_config import EnvConfig
from esper.report.statistics import paired_difference
from esper.tamiyo.periodic import periodic_schedule
from esper.tolaria.compute import TrainingCompute
from esper.tolaria.data import SyntheticImageDataModule
from esper.tolaria.data.base import HostDataModule

EPISODES = 3  # two groups of two envs, the second one short: padding is exercised
EPISODE_EPOCHS = 10
CHANNELS = [2, 4]
N_TRAIN, BATCH = 64, 32
CONTROLLERS = ("scripted", "static_final", "static_equal", "periodic", "no_growth")


def _data() -> SyntheticImageDataModule:
    return SyntheticImageDataModule(n_train=N_TRAIN, n_val=32, n_test=32, batch_size=BATCH)


def _config() -> EnvConfig:
    return EnvConfig(n_envs=2, episode_epochs=EPISODE_EPOCHS, host_kwargs={"channels": CHANNELS})


def _compare(controllers: tuple[str, ...], data: HostDataModule | None = None) -> Evaluation:
    return compare(
        _config(),
        data or _data(),
        controllers,
        episodes=EPISODES,
        seed=0,
        grower="scripted",
    )


@pytest.fixture(scope="module")
def evaluation() -> Evaluation:
    return _compare(CONTROLLERS)


def _result(evaluation: Evaluation, name: str):  # type: ignore[no-untyped-def]
    return next(r for r in evaluation.results if r.controller == name)


def test_rows_come_back_in_the_order_asked_for_though_the_grower_runs_first(
    evaluation: Evaluation,
) -> None:
    assert [r.controller for r in evaluation.results] == list(CONTROLLERS)
    assert evaluation.groups == (0, 0, 1)


def test_static_final_trains_each_grower_episodes_final_network_from_the_first_epoch(
    evaluation: Evaluation,
) -> None:
    grown, static = _result(evaluation, "scripted"), _result(evaluation, "static_final")
    alone = _result(evaluation, "no_growth")
    assert min(grown.params_final) > max(alone.params_final)  # a grown network to copy
    assert static.params_final == grown.params_final  # the same network, episode by episode
    assert static.seeds_germinated_mean == 0
    in_final = {int(s) for s in (SeedStage.BLENDING, SeedStage.HOLDING, SeedStage.FOSSILIZED)}
    kept = np.bincount(evaluation.groups)  # the last group's spare envs are not episodes
    for keep, grown_steps, static_steps in zip(
        kept, evaluation.steps["scripted"], evaluation.steps["static_final"], strict=True
    ):
        ended = np.isin(grown_steps[-1].stages[:keep], list(in_final))
        first = static_steps[0].stages[:keep] == int(SeedStage.FOSSILIZED)
        assert np.array_equal(first, ended)  # built before epoch 1, in the grower's slots


def test_static_equal_is_the_plain_host_widened_to_the_growers_mean_size(
    evaluation: Evaluation,
) -> None:
    grown, equal = _result(evaluation, "scripted"), _result(evaluation, "static_equal")
    target = grown.params_final_mean
    assert abs(equal.params_final_mean - target) <= DEFAULT_TOLERANCE * target
    assert set(equal.params_final) == {equal.params_final_mean}  # one plain network
    assert equal.seeds_germinated_mean == 0
    kwargs = evaluation.static_equal_host_kwargs
    assert kwargs is not None
    assert all(w >= c for w, c in zip(kwargs["channels"], CHANNELS, strict=True))
    assert sum(kwargs["channels"]) > sum(CHANNELS)


def test_every_row_pairs_test_accuracy_with_no_growth_and_the_grower_by_episode_group(
    evaluation: Evaluation,
) -> None:
    reference = _result(evaluation, "no_growth")
    grower = _result(evaluation, "scripted")
    for r in evaluation.results:
        if r.controller != "no_growth":
            assert r.versus["no_growth"] == paired_difference(
                r.final_test_acc, reference.final_test_acc, evaluation.groups
            )
        if r.controller != "scripted":
            assert r.versus["scripted"] == paired_difference(
                r.final_test_acc, grower.final_test_acc, evaluation.groups
            )
        assert r.test.units == 2  # two episode groups, whatever the episodes
        assert r.test.low <= r.test.mean <= r.test.high
    assert "no_growth" not in reference.versus


def test_training_flops_are_the_layers_run_times_the_predictions_trained(
    evaluation: Evaluation,
) -> None:
    data = _data()
    plain = GrowingHost(CNNHost(data.input_shape, data.n_classes, channels=CHANNELS))
    per_prediction = TrainingCompute(data.train_dataset[:2]).per_prediction(plain)
    share = BATCH // _config().n_envs  # each env trains on its share of every batch
    predictions = (N_TRAIN // BATCH) * share * EPISODE_EPOCHS
    alone = _result(evaluation, "no_growth")
    assert alone.train_flops == (per_prediction * predictions,) * EPISODES
    grown, static = _result(evaluation, "scripted"), _result(evaluation, "static_final")
    # The grown network exists from the start in static_final, only from mid-episode
    # in the grower: the grower trains it for less.
    assert alone.train_flops_mean < grown.train_flops_mean < static.train_flops_mean


def test_periodic_plants_only_at_its_scheduled_epochs_and_repeats_itself(
    evaluation: Evaluation,
) -> None:
    schedule = periodic_schedule(EPISODE_EPOCHS, len(CHANNELS), _config().lifecycle)
    planted = {
        event.host_epoch
        for steps in evaluation.steps["periodic"]
        for step in steps
        for event in step.events
        if event.kind == "germinated"
    }
    assert planted and planted <= set(schedule)
    assert not any(
        event.kind == "pruned"
        for steps in evaluation.steps["periodic"]
        for step in steps
        for event in step.events
    )
    again = _compare(("periodic",))
    first = [s.actions for steps in evaluation.steps["periodic"] for s in steps]
    second = [s.actions for steps in again.steps["periodic"] for s in steps]
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert again.results[0].final_test_acc == _result(evaluation, "periodic").final_test_acc


def test_the_test_split_is_read_once_per_episode_group_after_its_episodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    data = _data()
    loader = data.host_test_dataloader
    monkeypatch.setattr(data, "host_test_dataloader", lambda: reads.append(1) or loader())
    _compare(("no_growth",), data)
    assert len(reads) == math.ceil(EPISODES / _config().n_envs)


def test_the_written_json_keys_every_per_episode_figure_by_controller(
    evaluation: Evaluation, tmp_path: Path
) -> None:
    paths = evaluation.write(tmp_path)
    payload = json.loads(paths["json"].read_text())
    assert payload["grower"] == "scripted" and payload["seed_range"] == "tuning"
    assert payload["episode_group"] == [0, 0, 1]
    for key in ("final_test_acc", "final_val_acc", "params_final", "train_flops"):
        assert set(payload[key]) == set(CONTROLLERS)
        assert all(len(v) == EPISODES for v in payload[key].values())
    rows = {row["controller"]: row for row in payload["rows"]}
    assert rows["no_growth"]["vs_no_growth_mean"] is None  # NaN is written as null
    for name in CONTROLLERS:
        result = _result(evaluation, name)
        assert rows[name]["params_final_mean"] == result.params_final_mean
        assert rows[name]["train_flops_mean"] == result.train_flops_mean
        assert rows[name]["final_test_acc_mean"] == pytest.approx(np.mean(result.final_test_acc))
    table = evaluation.table()
    assert table.splitlines()[0].split()[:3] == ["controller", "test", "acc"]


def test_the_table_keeps_its_columns_and_says_n_a_where_one_group_gives_no_spread(
    evaluation: Evaluation,
) -> None:
    """Every line as wide as the header (the test-accuracy cells ran two characters past
    it), and an interval or standard error that one episode group cannot give reads n/a,
    not "[nan, nan]" and "± nan"."""
    lines = evaluation.table().splitlines()
    assert len({len(line) for line in lines}) == 1, lines
    assert "nan" not in evaluation.table()
    alone = replace(
        evaluation,
        results=[
            replace(
                r,
                test=replace(r.test, se=math.nan, low=math.nan, high=math.nan, units=1),
                versus={k: replace(e, se=math.nan) for k, e in r.versus.items()},
            )
            for r in evaluation.results
        ],
    )
    table = alone.table()
    assert "nan" not in table and "[n/a: one group]" in table and "± n/a pts" in table
    assert len({len(line) for line in table.splitlines()}) == 1, table


@pytest.mark.parametrize(
    ("controllers", "grower", "message"),
    [
        (("oracle",), "scripted", "unknown controllers"),
        (("no_growth", "no_growth"), "scripted", "more than once"),
        (("static_final", "no_growth"), "scripted", "add it to the controllers"),
        (("no_growth",), "no_growth", "must be one of"),
        (("learned",), "learned", "needs a policy"),
    ],
)
def test_a_comparison_that_cannot_run_says_why_before_running(
    controllers: tuple[str, ...], grower: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compare(_config(), _data(), controllers, 1, 0, grower=grower)


@given(
    a=st.tuples(st.sampled_from([TUNING_SEEDS, REPORTING_SEEDS]), st.integers(0, 999)),
    b=st.tuples(st.sampled_from([TUNING_SEEDS, REPORTING_SEEDS]), st.integers(0, 999)),
    groups=st.tuples(st.integers(0, GROUPS_PER_SEED - 1), st.integers(0, GROUPS_PER_SEED - 1)),
)
def test_no_two_evaluation_seeds_share_an_episode(
    a: tuple[range, int], b: tuple[range, int], groups: tuple[int, int]
) -> None:
    seed_a, seed_b = a[0][a[1]], b[0][b[1]]
    same = (seed_a, groups[0]) == (seed_b, groups[1])
    assert (group_key(seed_a, groups[0]) == group_key(seed_b, groups[1])) == same


def test_seeds_outside_both_ranges_and_groups_past_the_limit_are_refused() -> None:
    # What used to happen: seed 1's group 0 was seed 0's group 1.
    assert group_key(1, 0) != group_key(0, 1)
    with pytest.raises(ValueError, match="neither range"):
        group_key(REPORTING_SEEDS.stop, 0)
    with pytest.raises(ValueError, match="outside"):
        group_key(0, GROUPS_PER_SEED)
    assert TUNING_SEEDS.stop <= REPORTING_SEEDS.start  # the ranges do not overlap
