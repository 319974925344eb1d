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
    patched = (
        stacking.epoch_module._train_batches,
        stacking.epoch_module._train_step,
        stacking.stacked.StackedGroup.step,
    )
    result = stacking.count_groups(FIT)
    assert result["host_epochs"] == 3  # one rollout of 3-epoch episodes
    assert result["env_epochs"] == 4 * 3
    assert result["env_steps"] > 0 and result["env_steps"] % 12 == 0  # each env, each batch
    # The first epoch's four envs start alike (paired): at least one group of 4 then.
    assert 4 / 12 <= result["stacked_share"] <= 1
    assert 2 <= result["mean_group"] <= 4
    # A step per group and per env alone, every batch: 1 (all four stacked) to 4.
    assert 1 <= result["steps_per_batch"] <= 4
    assert steps and max(steps) == 4  # the engine itself stacked that group
    assert patched == (  # restored
        stacking.epoch_module._train_batches,
        stacking.epoch_module._train_step,
        stacking.stacked.StackedGroup.step,
    )


def test_the_tally_counts_the_steps_of_groups_split_by_share_size() -> None:
    """Unpaired, 3 envs on batches of 64: env 0 takes 22 samples, envs 1 and 2 take 21, so
    the envs that start alike train as envs 1-2 stacked and env 0 alone, every batch."""
    fit = [
        *FIT,
        "--model.n_envs",
        "3",
        "--model.ppo.paired_envs",
        "false",
        "--model.ppo.critic_baseline",
        "true",
        "--model.ppo.vf_coef",
        "0.5",
        "--data.batch_size",
        "64",
    ]
    fit += ["--model.ppo.n_minibatches", "1", "--trainer.max_epochs", "1"]
    result = stacking.count_groups(fit)
    # The first host epoch is alike for all; later ones may split further, never merge.
    assert result["stacked_share"] <= 2 / 3
    assert result["mean_group"] == 2
    assert result["steps_per_batch"] >= 2
