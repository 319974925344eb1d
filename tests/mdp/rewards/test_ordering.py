"""Episode returns rank outcomes as final accuracy does, then by parameters added.

Controllers are driven through whole episodes whose end states are known: their
accuracy paths, seeds, contributions and fossilizations. Whatever happened on the way,
the one that ends with the higher accuracy must earn more, so a controller that ends
below no growth never out-earns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from esper.mdp.rewards import REWARDS, RewardConfig, RewardInputs
from esper.mdp.rewards.base import total

#: One validation image on the default data (digits: 360 validation images): the
#: smallest accuracy difference an evaluation can show.
ACC_RESOLUTION = 1 / 360
#: Longest episode the default rent is sized for (see RewardConfig.param_penalty_weight).
MAX_STEPS = 40
SLOTS = 3
#: How far two sums of per-step rewards may differ by rounding alone when they telescope
#: over different accuracy paths to the same end (float64 sums of up to 40 steps).
PATH_ROUNDING = 1e-6
FAMILIES = ("shaped", "sparse")


@dataclass(frozen=True)
class Episode:
    """What a controller did over one episode of one env, step by step."""

    acc: list[float]  # accuracy after each step; the episode starts at START_ACC
    seed_params: list[int]
    contribution: list[list[float]]
    blending: list[list[bool]]
    fossilized: list[bool]

    @property
    def final(self) -> float:
        return self.acc[-1]


START_ACC = 0.5


def episode_return(episode: Episode, family: str, config: RewardConfig) -> float:
    reward = REWARDS.get(family)
    steps = len(episode.acc)
    prev = START_ACC
    earned = 0.0
    for t in range(steps):
        inputs = RewardInputs(
            val_acc=np.array([episode.acc[t]]),
            prev_val_acc=np.array([prev]),
            contribution=np.array([episode.contribution[t]]),
            blending=np.array([episode.blending[t]]),
            seed_params=np.array([episode.seed_params[t]], dtype=np.int64),
            illegal_op=np.array([False]),
            wasted_op=np.array([False]),
            fossilized=np.array([episode.fossilized[t]]),
            terminal=np.array([t == steps - 1]),
            rollback=np.array([False]),
        )
        earned += float(total(reward(inputs, config))[0])
        prev = episode.acc[t]
    return earned


def no_growth(acc: list[float]) -> Episode:
    n = len(acc)
    return Episode(acc, [0] * n, [[0.0] * SLOTS] * n, [[False] * SLOTS] * n, [False] * n)


@st.composite
def episodes(draw: st.DrawFn, steps: int) -> Episode:
    budget = RewardConfig().param_budget
    unit = st.floats(0.0, 1.0, allow_nan=False)
    params = sorted(draw(st.lists(st.integers(0, budget), min_size=steps, max_size=steps)))
    return Episode(
        acc=draw(st.lists(unit, min_size=steps, max_size=steps)),
        seed_params=params,
        contribution=draw(
            st.lists(
                st.lists(st.floats(-1.0, 1.0), min_size=SLOTS, max_size=SLOTS),
                min_size=steps,
                max_size=steps,
            )
        ),
        blending=draw(
            st.lists(
                st.lists(st.booleans(), min_size=SLOTS, max_size=SLOTS),
                min_size=steps,
                max_size=steps,
            )
        ),
        fossilized=draw(st.lists(st.booleans(), min_size=steps, max_size=steps)),
    )


@st.composite
def paired_episodes(draw: st.DrawFn) -> tuple[Episode, Episode]:
    steps = draw(st.integers(1, MAX_STEPS))
    return draw(episodes(steps)), draw(episodes(steps))


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None)
@given(pair=paired_episodes())
def test_a_higher_final_accuracy_always_earns_more(
    family: str, pair: tuple[Episode, Episode]
) -> None:
    a, b = pair
    config = RewardConfig()
    assume(abs(a.final - b.final) >= ACC_RESOLUTION)  # a difference an evaluation can see
    better, worse = (a, b) if a.final > b.final else (b, a)
    assert episode_return(better, family, config) > episode_return(worse, family, config)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=40, deadline=None)
@given(pair=paired_episodes())
def test_at_equal_final_accuracy_fewer_parameters_earn_at_least_as_much(
    family: str, pair: tuple[Episode, Episode]
) -> None:
    # Two episodes that end at the same accuracy by different paths, with different seeds
    # and contributions on the way: the one that added fewer parameters at every step
    # earns at least as much.
    a, b = pair
    lean_params = [min(x, y) for x, y in zip(a.seed_params, b.seed_params, strict=True)]
    assume(lean_params != b.seed_params)
    lean = Episode([*a.acc[:-1], b.final], lean_params, *_rest(a))
    assert lean.final == b.final
    config = RewardConfig()
    # Different paths sum different accuracy steps: equal up to float rounding.
    assert episode_return(lean, family, config) >= episode_return(b, family, config) - PATH_ROUNDING


def _rest(e: Episode) -> tuple[list[list[float]], list[list[bool]], list[bool]]:
    return e.contribution, e.blending, e.fossilized


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grower_that_ends_below_no_growth_never_out_earns_it(family: str) -> None:
    """The case that made the old reward pay for losing accuracy (issue 13).

    The grower's host leans on its seeds (large counterfactual contributions), fossilizes
    three of them, and ends two points below the host left alone.
    """
    steps = 24
    alone = no_growth([0.9 + 0.003 * t for t in range(steps)])
    grown = Episode(
        acc=[a - 0.02 * t / (steps - 1) for a, t in zip(alone.acc, range(steps), strict=True)],
        seed_params=[3_000] * steps,
        contribution=[[0.3, 0.2, 0.1]] * steps,
        blending=[[True] * SLOTS] * steps,
        fossilized=[t in (8, 14, 20) for t in range(steps)],
    )
    config = RewardConfig()
    assert grown.final < alone.final
    assert episode_return(grown, family, config) < episode_return(alone, family, config)
