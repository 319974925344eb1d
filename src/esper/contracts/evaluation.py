"""The words of an evaluation: which controllers exist, and which evaluation seeds are for
tuning and which for reporting.

Plain data, so the command line can offer them without importing torch.

Evaluation seeds are split in two ranges. Defaults (blueprints, thresholds, learning
settings) are chosen by looking at episodes of the tuning range only; figures are
reported on the reporting range, on episodes nothing was chosen on. Each seed's
episodes are its own: no two seeds share one (``esper.evaluation.episodes.group_key``).
"""

from __future__ import annotations

#: Evaluation seeds on which defaults may be chosen: look at these while tuning.
TUNING_SEEDS = range(0, 1000)
#: Evaluation seeds figures are reported on (README, benchmarks/README): nothing is
#: chosen by looking at them.
REPORTING_SEEDS = range(1000, 2000)

#: Controllers that grow the host, each deciding for itself: the policy a checkpoint
#: holds, a fixed schedule, the hand-written heuristic, the scripted grower, and random
#: legal choices.
GROWERS: tuple[str, ...] = ("learned", "periodic", "heuristic", "scripted", "random")
#: Controls that copy a grower's outcome into a network chosen up front: its final
#: architectures trained from the start, and the plain host widened to its size.
STATIC_CONTROLS: tuple[str, ...] = ("static_final", "static_equal")
#: The host left alone.
NO_GROWTH = "no_growth"
#: Every controller an evaluation can run.
ALL_CONTROLLERS: tuple[str, ...] = (*GROWERS, *STATIC_CONTROLS, NO_GROWTH)
#: What ``esper evaluate`` runs unless told otherwise: the learned grower and every control.
DEFAULT_CONTROLLERS: tuple[str, ...] = (
    "learned",
    "static_final",
    "static_equal",
    "periodic",
    "random",
    NO_GROWTH,
)
#: The grower the static controls copy unless told otherwise.
DEFAULT_GROWER = "learned"


def seed_range(seed: int) -> str:
    """``"tuning"`` or ``"reporting"``: the range evaluation seed ``seed`` belongs to."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"an evaluation seed is an int, got {seed!r}")
    for name, seeds in (("tuning", TUNING_SEEDS), ("reporting", REPORTING_SEEDS)):
        if seed in seeds:
            return name
    raise ValueError(
        f"evaluation seed {seed} is in neither range: tune on {span(TUNING_SEEDS)}, report "
        f"on {span(REPORTING_SEEDS)}"
    )


def span(seeds: range) -> str:
    """``"first-last"`` of a seed range, as the help and the errors print it."""
    return f"{seeds.start}-{seeds.stop - 1}"
