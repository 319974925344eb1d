"""The seed lifecycle state machine and its gates (kasmina/lifecycle.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.contracts import (
    LIVE_STAGES,
    TRANSITIONS,
    BlendMode,
    IllegalTransitionError,
    SeedStage,
    is_legal_transition,
)
from esper.contracts.stages import next_on_success_path
from esper.kasmina import GateResult, GateSignals, LifecycleConfig, SeedLifecycle

FAST = LifecycleConfig(
    min_training_epochs=0, blend_epochs=1, min_holding_epochs=0, embargo_epochs=1, reset_epochs=1
)
GOOD = GateSignals(grads_finite=True, contribution=1.0)


def _advance_until(lc: SeedLifecycle, target: SeedStage) -> None:
    """ADVANCE (counting epochs while a gate waits) until ``lc`` reaches ``target``."""
    for _ in range(100):
        if lc.stage is target:
            return
        if not lc.advance(GOOD):
            lc.end_epoch()
    raise AssertionError(f"stuck in {lc.stage.name} on the way to {target.name}")


def drive_to(stage: SeedStage, config: LifecycleConfig = FAST) -> SeedLifecycle:
    """A lifecycle brought to ``stage`` by the public API only."""
    lc = SeedLifecycle(config)
    if stage is SeedStage.DORMANT:
        return lc
    lc.germinate("conv_light", BlendMode.LINEAR)
    if stage in LIVE_STAGES or stage is SeedStage.FOSSILIZED:
        _advance_until(lc, stage)
        return lc
    lc.prune()
    for _ in range(100):
        if lc.stage is stage:
            return lc
        lc.end_epoch()
    raise AssertionError(stage)


def _advance(lc: SeedLifecycle) -> None:
    _advance_until(lc, _next_stage(lc.stage))


def _next_stage(stage: SeedStage) -> SeedStage:
    nxt = next_on_success_path(stage)
    assert nxt is not None
    return nxt


def _clock(lc: SeedLifecycle) -> None:
    assert lc.end_epoch() is not None


OP_FOR_EDGE: dict[tuple[SeedStage, SeedStage], Callable[[SeedLifecycle], object]] = {
    (SeedStage.DORMANT, SeedStage.GERMINATED): lambda lc: lc.germinate("norm", BlendMode.COSINE),
    (SeedStage.GERMINATED, SeedStage.TRAINING): _advance,
    (SeedStage.TRAINING, SeedStage.BLENDING): _advance,
    (SeedStage.BLENDING, SeedStage.HOLDING): _advance,
    (SeedStage.HOLDING, SeedStage.FOSSILIZED): _advance,
    **{(live, SeedStage.PRUNED): SeedLifecycle.prune for live in LIVE_STAGES},
    (SeedStage.PRUNED, SeedStage.EMBARGOED): _clock,
    (SeedStage.EMBARGOED, SeedStage.RESETTING): _clock,
    (SeedStage.RESETTING, SeedStage.DORMANT): _clock,
}
LEGAL = sorted((src, dst) for src, dsts in TRANSITIONS.items() for dst in dsts)


def test_every_graph_edge_has_a_public_lifecycle_op() -> None:
    assert set(OP_FOR_EDGE) == set(LEGAL)


@pytest.mark.parametrize("edge", LEGAL, ids=lambda e: f"{e[0].name}->{e[1].name}")
def test_every_legal_transition_succeeds_through_the_public_api(
    edge: tuple[SeedStage, SeedStage],
) -> None:
    src, dst = edge
    lc = drive_to(src)
    assert lc.stage is src
    OP_FOR_EDGE[edge](lc)
    assert lc.stage is dst
    assert lc.epochs_in_stage == 0


NOT_ADVANCEABLE = [
    SeedStage.DORMANT,
    SeedStage.FOSSILIZED,
    SeedStage.PRUNED,
    SeedStage.EMBARGOED,
    SeedStage.RESETTING,
]
NOT_PRUNABLE = [s for s in SeedStage if s not in LIVE_STAGES]
NOT_GERMINABLE = [s for s in SeedStage if s is not SeedStage.DORMANT]


def _snapshot(lc: SeedLifecycle) -> tuple:
    return (lc.stage, lc.epochs_in_stage, lc.blueprint, lc.blend_mode)


@pytest.mark.parametrize("stage", NOT_ADVANCEABLE, ids=lambda s: s.name)
def test_advance_from_a_stage_off_the_success_path_raises_and_changes_nothing(
    stage: SeedStage,
) -> None:
    lc = drive_to(stage)
    before = _snapshot(lc)
    with pytest.raises(IllegalTransitionError, match=f"ADVANCE is not defined from {stage.name}"):
        lc.advance(GOOD)
    assert _snapshot(lc) == before


@pytest.mark.parametrize("stage", NOT_PRUNABLE, ids=lambda s: s.name)
def test_prune_outside_live_stages_raises_and_changes_nothing(stage: SeedStage) -> None:
    lc = drive_to(stage)
    before = _snapshot(lc)
    with pytest.raises(IllegalTransitionError, match=f"{stage.name} -> PRUNED"):
        lc.prune()
    assert _snapshot(lc) == before


@pytest.mark.parametrize("stage", NOT_GERMINABLE, ids=lambda s: s.name)
def test_germinate_outside_dormant_raises_and_changes_nothing(stage: SeedStage) -> None:
    lc = drive_to(stage)
    before = _snapshot(lc)
    with pytest.raises(IllegalTransitionError, match=f"{stage.name} -> GERMINATED"):
        lc.germinate("mlp", BlendMode.SIGMOID)
    assert _snapshot(lc) == before


def test_germinate_with_invalid_blend_mode_raises_before_changing_state() -> None:
    lc = SeedLifecycle()
    with pytest.raises(ValueError):
        lc.germinate("norm", 42)  # type: ignore[arg-type]
    assert _snapshot(lc) == (SeedStage.DORMANT, 0, None, None)


def test_germinate_records_blueprint_and_blend_mode() -> None:
    lc = SeedLifecycle()
    lc.germinate("lora", 2)  # type: ignore[arg-type]
    assert lc.blueprint == "lora"
    assert lc.blend_mode is BlendMode.SIGMOID
    assert lc.is_live


# ----------------------------------------------------------------------------- gates


@pytest.mark.parametrize(
    ("stage", "field", "label"),
    [
        (SeedStage.TRAINING, "min_training_epochs", "TRAINING"),
        (SeedStage.BLENDING, "blend_epochs", "BLENDING"),
        (SeedStage.HOLDING, "min_holding_epochs", "HOLDING"),
    ],
)
@pytest.mark.parametrize("minimum", [1, 3])
def test_advance_is_refused_with_a_reason_until_min_epochs_in_stage(
    stage: SeedStage, field: str, label: str, minimum: int
) -> None:
    fast = {
        "min_training_epochs": 0,
        "blend_epochs": 1,
        "min_holding_epochs": 0,
    }
    config = LifecycleConfig(**{**fast, field: minimum})
    lc = drive_to(stage, config)
    for n in range(minimum):
        assert lc.epochs_in_stage == n
        result = lc.advance(GOOD)
        assert isinstance(result, GateResult)
        assert not result
        assert result.reason == f"{label} for {n} of {minimum} epochs"
        assert lc.last_refusal == result.reason
        assert lc.stage is stage
        lc.end_epoch()
    result = lc.advance(GOOD)
    assert result and result.reason == ""
    assert lc.stage is _next_stage(stage)
    assert lc.last_refusal == ""


@pytest.mark.parametrize("stage", [SeedStage.TRAINING, SeedStage.BLENDING, SeedStage.HOLDING])
def test_advance_is_refused_when_gradients_were_not_finite(stage: SeedStage) -> None:
    lc = drive_to(stage)
    result = lc.advance(GateSignals(grads_finite=False, contribution=1.0))
    assert not result
    assert "not finite" in result.reason
    assert lc.stage is stage
    assert lc.last_refusal == result.reason


def test_germinated_seed_enters_training_without_gradient_evidence() -> None:
    lc = drive_to(SeedStage.GERMINATED)
    assert lc.advance(GateSignals(grads_finite=False, contribution=-1.0))
    assert lc.stage is SeedStage.TRAINING


@given(contribution=st.one_of(st.floats(max_value=0.0), st.just(math.nan)))
def test_fossilize_is_refused_without_positive_contribution(contribution: float) -> None:
    lc = drive_to(SeedStage.HOLDING)
    result = lc.advance(GateSignals(grads_finite=True, contribution=contribution))
    assert not result
    assert "contribution" in result.reason and "is not above" in result.reason
    assert lc.stage is SeedStage.HOLDING


@given(
    threshold=st.floats(min_value=-1.0, max_value=1.0),
    contribution=st.floats(min_value=-2.0, max_value=2.0),
)
def test_fossilize_passes_exactly_when_contribution_exceeds_threshold(
    threshold: float, contribution: float
) -> None:
    config = LifecycleConfig(
        min_training_epochs=0, blend_epochs=1, min_holding_epochs=0, min_contribution=threshold
    )
    lc = drive_to(SeedStage.HOLDING, config)
    result = lc.advance(GateSignals(grads_finite=True, contribution=contribution))
    assert bool(result) is (contribution > threshold)
    assert lc.stage is (SeedStage.FOSSILIZED if contribution > threshold else SeedStage.HOLDING)


def test_contribution_gate_does_not_apply_before_holding() -> None:
    lc = drive_to(SeedStage.TRAINING)
    assert lc.advance(GateSignals(grads_finite=True, contribution=-5.0))
    assert lc.stage is SeedStage.BLENDING


def test_refusal_reason_is_cleared_by_a_later_success() -> None:
    lc = drive_to(SeedStage.TRAINING, LifecycleConfig(min_training_epochs=1))
    assert not lc.advance(GOOD)
    assert lc.last_refusal
    lc.end_epoch()
    assert lc.advance(GOOD)
    assert lc.last_refusal == ""


def test_gate_result_is_truthy_only_when_passed() -> None:
    assert GateResult(True)
    assert not GateResult(False, "why")


# ------------------------------------------------------------------------- cool-down


@pytest.mark.parametrize(("embargo", "reset"), [(1, 1), (2, 1), (3, 2), (1, 4)])
def test_cooldown_runs_pruned_embargoed_resetting_dormant_by_the_clock(
    embargo: int, reset: int
) -> None:
    lc = SeedLifecycle(LifecycleConfig(embargo_epochs=embargo, reset_epochs=reset))
    lc.germinate("norm", BlendMode.LINEAR)
    lc.prune()
    entered: list[tuple[int, SeedStage]] = []
    for epoch in range(1, 1 + 1 + embargo + reset + 3):
        stage = lc.end_epoch()
        if stage is not None:
            entered.append((epoch, stage))
    assert entered == [
        (1, SeedStage.EMBARGOED),
        (1 + embargo, SeedStage.RESETTING),
        (1 + embargo + reset, SeedStage.DORMANT),
    ]
    assert lc.stage is SeedStage.DORMANT


def test_slot_is_reusable_after_cooldown_with_blueprint_forgotten() -> None:
    lc = drive_to(SeedStage.RESETTING)
    assert lc.blueprint == "conv_light"
    assert lc.end_epoch() is SeedStage.DORMANT
    assert lc.blueprint is None and lc.blend_mode is None
    lc.germinate("mlp", BlendMode.GATED)
    assert lc.stage is SeedStage.GERMINATED and lc.blueprint == "mlp"


@pytest.mark.parametrize(
    "stage",
    [s for s in SeedStage if s not in (SeedStage.PRUNED, SeedStage.EMBARGOED, SeedStage.RESETTING)],
    ids=lambda s: s.name,
)
def test_clock_only_counts_epochs_outside_cooldown(stage: SeedStage) -> None:
    lc = drive_to(stage)
    for n in range(1, 6):
        assert lc.end_epoch() is None
        assert lc.stage is stage
        assert lc.epochs_in_stage == n


# ---------------------------------------------------------------------------- alpha


@pytest.mark.parametrize(
    "stage",
    [
        SeedStage.DORMANT,
        SeedStage.GERMINATED,
        SeedStage.TRAINING,
        SeedStage.PRUNED,
        SeedStage.EMBARGOED,
        SeedStage.RESETTING,
    ],
    ids=lambda s: s.name,
)
def test_alpha_is_zero_where_the_seed_is_not_blended(stage: SeedStage) -> None:
    assert drive_to(stage).alpha == 0.0


@pytest.mark.parametrize("stage", [SeedStage.HOLDING, SeedStage.FOSSILIZED])
def test_alpha_is_one_once_blending_is_done(stage: SeedStage) -> None:
    assert drive_to(stage).alpha == 1.0


@settings(max_examples=50)
@given(mode=st.sampled_from(list(BlendMode)), blend_epochs=st.integers(1, 30))
def test_blending_alpha_ramps_up_within_the_schedule_and_reaches_one_on_its_last_epoch(
    mode: BlendMode, blend_epochs: int
) -> None:
    config = LifecycleConfig(min_training_epochs=0, blend_epochs=blend_epochs)
    lc = SeedLifecycle(config)
    lc.germinate("norm", mode)
    _advance_until(lc, SeedStage.BLENDING)
    alphas = []
    for _ in range(blend_epochs):
        alphas.append(lc.alpha)
        assert not lc.advance(GOOD)
        lc.end_epoch()
    assert alphas[0] > 0.0
    assert alphas[-1] == 1.0
    assert all(0.0 < a <= 1.0 for a in alphas)
    assert alphas == sorted(alphas)
    assert lc.advance(GOOD)
    assert lc.stage is SeedStage.HOLDING


# ----------------------------------------------------------------------- random walks

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("germinate"), st.sampled_from(list(BlendMode))),
        st.tuples(st.just("advance"), st.booleans(), st.floats(-1.0, 1.0)),
        st.just(("prune",)),
        st.just(("end_epoch",)),
    ),
    max_size=40,
)


@settings(max_examples=150)
@given(
    ops=OPS,
    config=st.builds(
        LifecycleConfig,
        min_training_epochs=st.integers(0, 2),
        blend_epochs=st.integers(1, 3),
        min_holding_epochs=st.integers(0, 2),
        embargo_epochs=st.integers(1, 3),
        reset_epochs=st.integers(1, 3),
    ),
)
def test_any_op_sequence_only_ever_takes_graph_edges(
    ops: list[tuple], config: LifecycleConfig
) -> None:
    lc = SeedLifecycle(config)
    for op in ops:
        before = _snapshot(lc)
        try:
            if op[0] == "germinate":
                lc.germinate("norm", op[1])
            elif op[0] == "advance":
                lc.advance(GateSignals(grads_finite=op[1], contribution=op[2]))
            elif op[0] == "prune":
                lc.prune()
            else:
                lc.end_epoch()
        except IllegalTransitionError:
            assert _snapshot(lc) == before
            continue
        src, dst = before[0], lc.stage
        assert src is dst or is_legal_transition(src, dst)
        assert (lc.blueprint is None) is (lc.stage is SeedStage.DORMANT)
        assert 0.0 <= lc.alpha <= 1.0


# ----------------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_training_epochs", -1),
        ("min_holding_epochs", -1),
        ("blend_epochs", 0),
        ("embargo_epochs", 0),
        ("reset_epochs", 0),
        ("blend_epochs", 1.5),
        ("min_training_epochs", "2"),
        ("embargo_epochs", True),
        ("reset_epochs", None),
        ("min_contribution", math.nan),
        ("min_contribution", math.inf),
        ("min_contribution", -math.inf),
        ("min_contribution", "0.1"),
        ("min_contribution", None),
    ],
)
def test_lifecycle_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"LifecycleConfig.{field}"):
        LifecycleConfig(**{field: value})


def test_lifecycle_config_accepts_minimum_values() -> None:
    cfg = LifecycleConfig(
        min_training_epochs=0,
        min_holding_epochs=0,
        blend_epochs=1,
        embargo_epochs=1,
        reset_epochs=1,
        min_contribution=-0.5,
    )
    assert cfg.min_contribution == -0.5
