"""Growth that pays: on a task where a seed must help, the grown host beats the host alone.

The host here is too small for the digits (two and four channels); the scripted grower
plants conv_heavy seeds in both slots at once, lets the clock carry them through
TRAINING (incubated as fitted residuals) and BLENDING, and fossilizes them. Over paired
episodes (same initial hosts, data order and seed initialisations) its final accuracy
must be higher in every episode and on average.
"""

from __future__ import annotations

import pytest

from esper.evaluation.episodes import baseline_controller, run_episodes
from esper.mdp.env_config import EnvConfig
from esper.tolaria.data import DigitsDataModule

EPISODES = 4
EPISODE_EPOCHS = 12
TOO_SMALL = {"channels": [2, 4]}


def _final_acc(name: str) -> list[float]:
    config = EnvConfig(n_envs=EPISODES, episode_epochs=EPISODE_EPOCHS, host_kwargs=TOO_SMALL)
    run = run_episodes(
        config,
        DigitsDataModule(),
        lambda env: baseline_controller(name, env),
        None,
        episodes=EPISODES,
        seed=0,
    )
    assert name == "no_growth" or run.per_episode["seeds_fossilized"].min() >= 1
    return run.per_episode["final_val_acc"].tolist()


@pytest.mark.slow
def test_a_grown_host_too_small_for_its_task_beats_the_same_host_alone() -> None:
    alone = _final_acc("no_growth")
    grown = _final_acc("scripted")
    gains = [g - a for g, a in zip(grown, alone, strict=True)]
    assert sum(gains) / len(gains) > 0.01, gains
    assert min(gains) > 0, gains
