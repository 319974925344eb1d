"""The seed lifecycle's stages and the one graph of legal transitions between them.

The graph lives here, as data, so the lifecycle state machine (kasmina), the action
masks (tamiyo) and telemetry all read the same truth.
"""

from __future__ import annotations

import itertools
from enum import IntEnum


class SeedStage(IntEnum):
    """Where a slot's seed is in its life. Integer values index observation one-hots."""

    DORMANT = 0
    GERMINATED = 1
    TRAINING = 2
    BLENDING = 3
    HOLDING = 4
    FOSSILIZED = 5
    PRUNED = 6
    EMBARGOED = 7
    RESETTING = 8


#: Stages in which a seed module exists and can still be cut.
LIVE_STAGES: frozenset[SeedStage] = frozenset(
    {SeedStage.GERMINATED, SeedStage.TRAINING, SeedStage.BLENDING, SeedStage.HOLDING}
)

#: The main line of success: ADVANCE moves one step along it.
SUCCESS_PATH: tuple[SeedStage, ...] = (
    SeedStage.DORMANT,
    SeedStage.GERMINATED,
    SeedStage.TRAINING,
    SeedStage.BLENDING,
    SeedStage.HOLDING,
    SeedStage.FOSSILIZED,
)

#: Stages the clock moves on by itself once their gate passes (GERMINATED -> TRAINING ->
#: BLENDING -> HOLDING): they only wait for time, so they are no decision for the policy.
CLOCK_STAGES: frozenset[SeedStage] = frozenset(
    {SeedStage.GERMINATED, SeedStage.TRAINING, SeedStage.BLENDING}
)

#: Stages whose seed's output reaches the host (blended in, or held at full weight): the
#: fused validation measures each one's counterfactual contribution, and the contribution
#: reward pays for it. In stage order.
CONTRIBUTING_STAGES: tuple[SeedStage, ...] = (SeedStage.BLENDING, SeedStage.HOLDING)

#: Stages whose seed can be judged (its contribution is measured): only these seeds are
#: offered to PRUNE.
JUDGEABLE_STAGES: frozenset[SeedStage] = frozenset(CONTRIBUTING_STAGES)

#: The cool-down after a prune; each step is taken by the clock, not by the policy.
COOLDOWN_PATH: tuple[SeedStage, ...] = (
    SeedStage.PRUNED,
    SeedStage.EMBARGOED,
    SeedStage.RESETTING,
    SeedStage.DORMANT,
)


def _build_transitions() -> dict[SeedStage, frozenset[SeedStage]]:
    graph: dict[SeedStage, set[SeedStage]] = {stage: set() for stage in SeedStage}
    for path in (SUCCESS_PATH, COOLDOWN_PATH):
        for src, dst in itertools.pairwise(path):
            graph[src].add(dst)
    for live in LIVE_STAGES:
        graph[live].add(SeedStage.PRUNED)
    return {stage: frozenset(dsts) for stage, dsts in graph.items()}


#: Every legal transition. Anything not listed here is an error.
TRANSITIONS: dict[SeedStage, frozenset[SeedStage]] = _build_transitions()


class IllegalTransitionError(ValueError):
    """Raised when code asks for a transition outside :data:`TRANSITIONS`.

    A refused *gate* is not an error (it is a legal no-op with a reason); asking for
    an edge that is not in the graph is a bug in the caller.
    """


def is_legal_transition(src: SeedStage, dst: SeedStage) -> bool:
    return dst in TRANSITIONS[src]


def check_transition(src: SeedStage, dst: SeedStage) -> None:
    """Raise :class:`IllegalTransitionError` unless ``src -> dst`` is in the graph."""
    if not is_legal_transition(src, dst):
        legal = ", ".join(s.name for s in sorted(TRANSITIONS[src])) or "none (terminal)"
        raise IllegalTransitionError(
            f"illegal seed transition {src.name} -> {dst.name}; "
            f"from {src.name} the legal next stages are: {legal}"
        )


def next_on_success_path(stage: SeedStage) -> SeedStage | None:
    """The stage ADVANCE leads to from ``stage``, or None where ADVANCE has no meaning."""
    if stage in SUCCESS_PATH[1:-1]:
        return SUCCESS_PATH[SUCCESS_PATH.index(stage) + 1]
    return None
