"""The one graph of legal seed transitions (contracts/stages.py)."""

from __future__ import annotations

import itertools

import pytest

from esper.contracts import (
    LIVE_STAGES,
    TRANSITIONS,
    IllegalTransitionError,
    SeedStage,
    check_transition,
    is_legal_transition,
)
from esper.contracts.stages import COOLDOWN_PATH, SUCCESS_PATH, next_on_success_path

LEGAL = sorted((src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts)
ILLEGAL = sorted(
    (src, dst)
    for src, dst in itertools.product(SeedStage, SeedStage)
    if dst not in TRANSITIONS[src]
)


def _edge_id(edge: tuple[SeedStage, SeedStage]) -> str:
    return f"{edge[0].name}->{edge[1].name}"


def test_graph_is_exactly_the_design_edges() -> None:
    expected = {
        (SeedStage.DORMANT, SeedStage.GERMINATED),
        (SeedStage.GERMINATED, SeedStage.TRAINING),
        (SeedStage.TRAINING, SeedStage.BLENDING),
        (SeedStage.BLENDING, SeedStage.HOLDING),
        (SeedStage.HOLDING, SeedStage.FOSSILIZED),
        (SeedStage.GERMINATED, SeedStage.PRUNED),
        (SeedStage.TRAINING, SeedStage.PRUNED),
        (SeedStage.BLENDING, SeedStage.PRUNED),
        (SeedStage.HOLDING, SeedStage.PRUNED),
        (SeedStage.PRUNED, SeedStage.EMBARGOED),
        (SeedStage.EMBARGOED, SeedStage.RESETTING),
        (SeedStage.RESETTING, SeedStage.DORMANT),
    }
    assert set(LEGAL) == expected


def test_every_stage_has_an_entry_and_fossilized_is_terminal() -> None:
    assert set(TRANSITIONS) == set(SeedStage)
    assert TRANSITIONS[SeedStage.FOSSILIZED] == frozenset()
    terminal = [stage for stage, dsts in TRANSITIONS.items() if not dsts]
    assert terminal == [SeedStage.FOSSILIZED]


def test_every_live_stage_and_only_live_stages_can_be_pruned() -> None:
    prunable = {src for src, dsts in TRANSITIONS.items() if SeedStage.PRUNED in dsts}
    assert prunable == set(LIVE_STAGES)
    assert SeedStage.FOSSILIZED not in LIVE_STAGES
    assert SeedStage.DORMANT not in LIVE_STAGES


@pytest.mark.parametrize("edge", LEGAL, ids=_edge_id)
def test_legal_edge_passes_check_transition(edge: tuple[SeedStage, SeedStage]) -> None:
    src, dst = edge
    assert is_legal_transition(src, dst)
    check_transition(src, dst)  # does not raise


@pytest.mark.parametrize("edge", ILLEGAL, ids=_edge_id)
def test_illegal_edge_is_refused_by_check_transition(edge: tuple[SeedStage, SeedStage]) -> None:
    src, dst = edge
    assert not is_legal_transition(src, dst)
    with pytest.raises(IllegalTransitionError, match=f"{src.name} -> {dst.name}"):
        check_transition(src, dst)


def test_legal_and_illegal_edges_partition_all_pairs() -> None:
    assert len(LEGAL) + len(ILLEGAL) == len(SeedStage) ** 2
    assert not set(LEGAL) & set(ILLEGAL)


def test_illegal_transition_error_is_a_value_error_listing_legal_next_stages() -> None:
    with pytest.raises(ValueError, match="legal next stages are: TRAINING, PRUNED"):
        check_transition(SeedStage.GERMINATED, SeedStage.HOLDING)


def test_illegal_transition_from_terminal_stage_says_terminal() -> None:
    with pytest.raises(IllegalTransitionError, match=r"none \(terminal\)"):
        check_transition(SeedStage.FOSSILIZED, SeedStage.PRUNED)


def test_success_and_cooldown_paths_are_chains_in_the_graph() -> None:
    for path in (SUCCESS_PATH, COOLDOWN_PATH):
        for src, dst in itertools.pairwise(path):
            assert is_legal_transition(src, dst)
    assert SUCCESS_PATH[0] is SeedStage.DORMANT and SUCCESS_PATH[-1] is SeedStage.FOSSILIZED
    assert COOLDOWN_PATH[0] is SeedStage.PRUNED and COOLDOWN_PATH[-1] is SeedStage.DORMANT


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (SeedStage.DORMANT, None),
        (SeedStage.GERMINATED, SeedStage.TRAINING),
        (SeedStage.TRAINING, SeedStage.BLENDING),
        (SeedStage.BLENDING, SeedStage.HOLDING),
        (SeedStage.HOLDING, SeedStage.FOSSILIZED),
        (SeedStage.FOSSILIZED, None),
        (SeedStage.PRUNED, None),
        (SeedStage.EMBARGOED, None),
        (SeedStage.RESETTING, None),
    ],
)
def test_next_on_success_path_defines_advance_only_for_live_stages(
    stage: SeedStage, expected: SeedStage | None
) -> None:
    assert next_on_success_path(stage) is expected


def test_stage_values_are_dense_one_hot_indices() -> None:
    assert sorted(int(s) for s in SeedStage) == list(range(len(SeedStage)))
