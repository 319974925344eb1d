"""Action masks follow the lifecycle: which ops, slots and blueprints are legal when."""

from __future__ import annotations

import numpy as np

from esper.contracts import ActionSchema, LifecycleOp, SeedStage
from esper.tamiyo.masks import MaskBuilder

SCHEMA = ActionSchema(("s0", "s1"), ("small", "big", "cnn_only"))
FITS = np.array([[True, True, True], [True, True, False]])
PARAMS = np.array([[10, 100, 20], [10, 100, 0]])
BUDGET = 120


def _masks(stages: list[list[SeedStage]], seed_params: list[int]) -> dict[str, np.ndarray]:
    builder = MaskBuilder(SCHEMA, FITS, PARAMS, BUDGET)
    return builder.build_numpy(np.array(stages, dtype=np.int64), np.array(seed_params))


def test_fresh_host_allows_only_wait_and_germinate_on_dormant_slots() -> None:
    m = _masks([[SeedStage.DORMANT, SeedStage.DORMANT]], [0])
    assert m["op"][0].tolist() == [True, True, False, False]
    assert m["slot"][0, LifecycleOp.GERMINATE].tolist() == [True, True]
    assert m["blueprint"][0].tolist() == [[True, True, True], [True, True, False]]


def test_live_seed_can_be_advanced_or_pruned_but_its_slot_not_germinated() -> None:
    m = _masks([[SeedStage.TRAINING, SeedStage.DORMANT]], [10])
    assert m["op"][0].all()
    assert m["slot"][0, LifecycleOp.ADVANCE].tolist() == [True, False]
    assert m["slot"][0, LifecycleOp.PRUNE].tolist() == [True, False]
    assert m["slot"][0, LifecycleOp.GERMINATE].tolist() == [False, True]


def test_fossilized_and_cooling_slots_allow_nothing_but_wait() -> None:
    for stage in (SeedStage.FOSSILIZED, SeedStage.PRUNED, SeedStage.EMBARGOED, SeedStage.RESETTING):
        m = _masks([[stage, stage]], [0])
        assert m["op"][0].tolist() == [True, False, False, False], stage


def test_blueprints_that_would_break_the_budget_are_masked() -> None:
    m = _masks([[SeedStage.DORMANT, SeedStage.DORMANT]], [BUDGET - 15])
    assert m["blueprint"][0, 0].tolist() == [True, False, False]
    m = _masks([[SeedStage.DORMANT, SeedStage.DORMANT]], [BUDGET - 5])
    assert not m["op"][0, LifecycleOp.GERMINATE]


def test_masks_are_per_env() -> None:
    m = _masks(
        [[SeedStage.DORMANT, SeedStage.DORMANT], [SeedStage.HOLDING, SeedStage.FOSSILIZED]], [0, 0]
    )
    assert m["op"].tolist() == [[True, True, False, False], [True, False, True, True]]


def test_is_legal_checks_every_head_the_op_uses() -> None:
    builder = MaskBuilder(SCHEMA, FITS, PARAMS, BUDGET)
    m = builder.build_numpy(np.array([[SeedStage.DORMANT, SeedStage.TRAINING]]), np.array([0]))
    assert builder.is_legal(m, 0, np.array([LifecycleOp.WAIT, 1, 2, 0]))
    assert builder.is_legal(m, 0, np.array([LifecycleOp.GERMINATE, 0, 2, 1]))
    assert not builder.is_legal(m, 0, np.array([LifecycleOp.GERMINATE, 1, 0, 0]))
    assert builder.is_legal(m, 0, np.array([LifecycleOp.ADVANCE, 1, 0, 0]))
    assert not builder.is_legal(m, 0, np.array([LifecycleOp.PRUNE, 0, 0, 0]))
