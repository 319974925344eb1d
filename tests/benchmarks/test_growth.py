"""``benchmarks/growth.py --plant-from K``: the periodic control planting at a chosen time."""

from __future__ import annotations

import pytest

from esper.tamiyo.periodic import periodic_config
from tests.benchmarks.loading import load_benchmark
from tests.mdp.envs import small_env

growth = load_benchmark("growth")


def test_plant_from_plants_one_slot_per_decision_from_that_epoch_else_as_periodic() -> None:
    env = small_env(1, episode_epochs=8)
    slots = len(env.schema.slot_ids)
    controller = growth.planting_from(3, env)
    assert controller.config.germinate_at == tuple((3 + i) / 8 for i in range(slots))
    periodic = periodic_config(env.schema, 8, env.config.lifecycle)
    assert controller.config.germinate_at != periodic.germinate_at
    for field in ("blueprint_preference", "retry_refused_advance", "plateau_delta"):
        assert getattr(controller.config, field) == getattr(periodic, field)


def test_plant_from_refuses_a_planting_after_the_last_decision() -> None:
    env = small_env(1, episode_epochs=4)
    with pytest.raises(SystemExit, match="--plant-from 3"):
        growth.planting_from(3, env)
