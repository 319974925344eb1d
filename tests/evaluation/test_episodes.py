"""The episode runner's baselines (evaluation/episodes.py) on every host kind."""

from __future__ import annotations

import pytest

from esper.contracts import ActionSchema
from esper.evaluation.episodes import baseline_controller, run_episodes
from esper.mdp.env_config import EnvConfig
from esper.tamiyo.heuristic import SCRIPTED_GROWTH, preferring_what_fits
from esper.tolaria.data import TokenSequenceDataModule


@pytest.mark.slow
def test_the_scripted_grower_grows_a_transformer_with_the_blueprints_it_has() -> None:
    """Its preference names the CNN's blueprints first; on a Transformer host, which has
    none of them, it plants the Transformer's counterpart instead of refusing to start."""
    data = TokenSequenceDataModule(seq_len=8, n_train=64, n_val=32, batch_size=16)
    config = EnvConfig(
        n_envs=2,
        episode_epochs=6,
        host="transformer",
        host_kwargs={"d_model": 16, "n_heads": 2, "n_layers": 1},
    )
    episodes = run_episodes(
        config,
        data,
        lambda env: baseline_controller("scripted", env),
        normalize=None,
        episodes=2,
        seed=0,
    )
    assert episodes.per_episode["seeds_germinated"].min() >= 1
    assert episodes.per_episode["params_added"].min() > 0


def test_a_preference_is_cut_to_the_blueprints_a_schema_offers() -> None:
    schema = ActionSchema(("layer0",), ("attention", "norm", "lora", "mlp"))
    kept = preferring_what_fits(SCRIPTED_GROWTH, schema)
    assert kept.blueprint_preference == ("mlp",)
    assert kept.prune_threshold == SCRIPTED_GROWTH.prune_threshold  # nothing else changes
