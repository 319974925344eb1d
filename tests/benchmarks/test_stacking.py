"""``benchmarks/stacking.py``: it tallies how a real fit's envs fell into stacked groups."""

from __future__ import annotations

import pytest

from tests.benchmarks.loading import load_benchmark
from tests.tolaria.stacking import count_stacked_steps

stacking = load_benchmark("stacking")

FIT = ["--model.n_envs", "4", "--model.episode_epochs", "3", "--trainer.max_epochs", "1"]
FIT += ["--model.host_kwargs", '{"channels": [2, 4]}', "--seed_everything", "0"]


def test_the_tally_counts_every_host_epoch_and_the_envs_that_trained_stacked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps = count_stacked_steps(monkeypatch)
    result = stacking.count_groups(FIT)
    assert result["host_epochs"] == 3  # one rollout of 3-epoch episodes
    assert result["env_epochs"] == 4 * 3
    # The first epoch's four envs start alike (paired): at least one group of 4 then.
    assert 4 / 12 <= result["stacked_share"] <= 1
    assert 2 <= result["mean_group"] <= 4
    # A step per group and per env alone, every batch: 1 (all four stacked) to 4.
    assert 1 <= result["steps_per_batch"] <= 4
    assert steps and max(steps) == 4  # the engine itself stacked that group
    assert stacking.epoch_module.stack_groups is stacking.stacked.stack_groups  # restored
