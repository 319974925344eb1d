"""The lifecycle clock moves seeds that wait only for time, and says what it moved
(kasmina/clock.py); the timing rules are stated once (``LifecycleConfig.epochs_due``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import BlendMode, SeedStage
from esper.contracts.stages import SUCCESS_PATH
from esper.kasmina import GateSignals, GrowingHost, LifecycleConfig, OptimConfig
from esper.kasmina.clock import ClockMove, after_decision, after_epoch
from esper.kasmina.lifecycle import SeedLifecycle
from tests.kasmina.factories import make_host

SLOW = LifecycleConfig(
    min_training_epochs=2, blend_epochs=2, min_holding_epochs=1, embargo_epochs=2, reset_epochs=1
)


def _grown(lifecycle: LifecycleConfig = SLOW) -> GrowingHost:
    return GrowingHost(make_host("cnn", lifecycle=lifecycle), OptimConfig(seed_lr=0.01))


def _finite(host: GrowingHost) -> np.ndarray:
    return np.ones(len(host.slot_ids), dtype=bool)


def test_a_seed_climbs_to_holding_by_the_clock_alone_after_each_stage_s_epochs() -> None:
    host = _grown()
    first = host.slot_ids[0]
    host.germinate(first, "norm", BlendMode.LINEAR)
    assert after_decision(host, _finite(host), just_planted=True) == []  # keeps its epoch
    stages = []
    for _ in range(8):
        after_epoch(host)
        moves = after_decision(host, _finite(host), just_planted=False)
        stages.append(host.model.slot(first).stage)
        assert all(m.slot_id == first and not m.refused for m in moves)
    T, B, H = SeedStage.TRAINING, SeedStage.BLENDING, SeedStage.HOLDING
    # GERMINATED -> TRAINING at once; 2 epochs of TRAINING, 2 of BLENDING; HOLDING stays
    # (FOSSILIZED is the policy's decision, not the clock's).
    assert stages == [T, T, B, B, H, H, H, H]


def test_non_finite_gradients_are_refused_once_until_they_clear() -> None:
    host = _grown(LifecycleConfig(min_training_epochs=0))
    first = host.slot_ids[0]
    host.germinate(first, "norm", BlendMode.LINEAR)
    after_epoch(host)
    after_decision(host, _finite(host), just_planted=False)  # to TRAINING
    bad = np.zeros(len(host.slot_ids), dtype=bool)
    refused = after_decision(host, bad, just_planted=False)
    assert refused == [ClockMove(first, SeedStage.TRAINING, SeedStage.TRAINING, refused[0].reason)]
    assert refused[0].refused and "not finite" in refused[0].reason
    assert after_decision(host, bad, just_planted=False) == []  # reported once
    moved = after_decision(host, _finite(host), just_planted=False)
    assert moved == [ClockMove(first, SeedStage.TRAINING, SeedStage.BLENDING)]


def test_after_epoch_reports_each_cooldown_move_with_the_stage_it_left() -> None:
    host = _grown()
    first, second = host.slot_ids[:2]
    host.germinate(first, "norm", BlendMode.LINEAR)
    host.germinate(second, "norm", BlendMode.LINEAR)
    host.prune(first)
    moves = [after_epoch(host) for _ in range(5)]
    P, E, R, D = SeedStage.PRUNED, SeedStage.EMBARGOED, SeedStage.RESETTING, SeedStage.DORMANT
    assert moves == [
        [ClockMove(first, P, E)],
        [],  # embargo_epochs=2
        [ClockMove(first, E, R)],
        [ClockMove(first, R, D)],
        [],
    ]
    assert host.model.slot(second).stage is SeedStage.GERMINATED  # not the clock's here


@given(
    training=st.integers(0, 4),
    blend=st.integers(1, 4),
    holding=st.integers(0, 4),
    epochs=st.integers(0, 6),
)
def test_served_agrees_with_the_gates_on_every_stage_of_the_way_up(
    training: int, blend: int, holding: int, epochs: int
) -> None:
    config = LifecycleConfig(
        min_training_epochs=training, blend_epochs=blend, min_holding_epochs=holding
    )
    for stage in SUCCESS_PATH[1:-1]:  # GERMINATED .. HOLDING: each has a next stage
        lifecycle = SeedLifecycle(config)
        lifecycle.stage, lifecycle.epochs_in_stage = stage, epochs
        waiting = lifecycle.gate_next(GateSignals(contribution=1.0)).waiting
        served = config.served(np.array([int(stage)]), np.array([epochs]))[0]
        assert served == (not waiting), (stage.name, epochs)


@pytest.mark.parametrize("stage", [SeedStage.PRUNED, SeedStage.EMBARGOED, SeedStage.RESETTING])
def test_cooldown_stages_last_their_epochs_due(stage: SeedStage) -> None:
    lifecycle = SeedLifecycle(SLOW)
    lifecycle.stage = stage
    due = SLOW.epochs_due(stage)
    entered = [lifecycle.end_epoch() for _ in range(due)]
    assert entered[:-1] == [None] * (due - 1) and entered[-1] is not None
