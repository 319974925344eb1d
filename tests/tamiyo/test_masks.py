"""Action masks follow the lifecycle: which ops, slots and blueprints are legal when."""

from __future__ import annotations

import numpy as np
import pytest

from esper.contracts import ActionSchema, LifecycleOp, SeedStage
from esper.kasmina import LifecycleConfig
from esper.tamiyo.masks import MaskBuilder

SCHEMA = ActionSchema(("s0", "s1"), ("small", "big", "cnn_only"))
FITS = np.array([[True, True, True], [True, True, False]])
PARAMS = np.array([[10, 100, 20], [10, 100, 0]])
BUDGET = 120
LIFECYCLE = LifecycleConfig(min_training_epochs=2, blend_epochs=3, min_holding_epochs=1)
#: Old enough for every clock: what a seed has spent in its stage when time is no object.
SETTLED = 10


def _masks(
    stages: list[list[SeedStage]], seed_params: list[int], epochs: list[list[int]] | None = None
) -> dict[str, np.ndarray]:
    builder = MaskBuilder(SCHEMA, FITS, PARAMS, BUDGET, LIFECYCLE)
    stage_array = np.array(stages, dtype=np.int64)
    epoch_array = (
        np.full(stage_array.shape, SETTLED) if epochs is None else np.array(epochs, dtype=np.int64)
    )
    return builder.build_numpy(stage_array, np.array(seed_params), epoch_array)


def test_fresh_host_allows_only_wait_and_germinate_on_dormant_slots() -> None:
    m = _masks([[SeedStage.DORMANT, SeedStage.DORMANT]], [0])
    assert m["op"][0].tolist() == [True, True, False, False]
    assert m["slot"][0, LifecycleOp.GERMINATE].tolist() == [True, True]
    assert m["blueprint"][0].tolist() == [[True, True, True], [True, True, False]]


def test_a_live_seed_blocks_germination_of_its_slot() -> None:
    m = _masks([[SeedStage.BLENDING, SeedStage.DORMANT]], [10])
    assert m["slot"][0, LifecycleOp.GERMINATE].tolist() == [False, True]


@pytest.mark.parametrize("stage", [SeedStage.GERMINATED, SeedStage.TRAINING, SeedStage.BLENDING])
def test_advance_is_never_offered_where_the_clock_moves_the_seed(stage: SeedStage) -> None:
    m = _masks([[stage, SeedStage.DORMANT]], [10])
    assert not m["slot"][0, LifecycleOp.ADVANCE].any()


def test_fossilize_is_offered_only_once_the_seed_has_held_long_enough() -> None:
    held = LIFECYCLE.min_holding_epochs
    young = _masks([[SeedStage.HOLDING, SeedStage.DORMANT]], [10], [[held - 1, 0]])
    assert not young["slot"][0, LifecycleOp.ADVANCE].any()
    ready = _masks([[SeedStage.HOLDING, SeedStage.DORMANT]], [10], [[held, 0]])
    assert ready["slot"][0, LifecycleOp.ADVANCE].tolist() == [True, False]


@pytest.mark.parametrize(
    ("stage", "epochs", "offered"),
    [
        (SeedStage.GERMINATED, SETTLED, False),  # nothing measured yet
        (SeedStage.TRAINING, LIFECYCLE.min_training_epochs - 1, False),  # too young
        (SeedStage.TRAINING, LIFECYCLE.min_training_epochs, True),  # stuck: grads not finite
        (SeedStage.BLENDING, 0, True),  # its contribution is measured
        (SeedStage.HOLDING, 0, True),
    ],
)
def test_prune_is_offered_only_for_a_seed_old_enough_to_judge(
    stage: SeedStage, epochs: int, offered: bool
) -> None:
    m = _masks([[stage, SeedStage.DORMANT]], [10], [[epochs, 0]])
    assert m["slot"][0, LifecycleOp.PRUNE].tolist() == [offered, False]


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
    builder = MaskBuilder(SCHEMA, FITS, PARAMS, BUDGET, LIFECYCLE)
    m = builder.build_numpy(
        np.array([[SeedStage.DORMANT, SeedStage.HOLDING]]),
        np.array([0]),
        np.array([[SETTLED, SETTLED]]),
    )
    assert builder.is_legal(m, 0, np.array([LifecycleOp.WAIT, 1, 2, 0]))
    assert builder.is_legal(m, 0, np.array([LifecycleOp.GERMINATE, 0, 2, 1]))
    assert not builder.is_legal(m, 0, np.array([LifecycleOp.GERMINATE, 1, 0, 0]))
    assert builder.is_legal(m, 0, np.array([LifecycleOp.ADVANCE, 1, 0, 0]))
    assert not builder.is_legal(m, 0, np.array([LifecycleOp.PRUNE, 0, 0, 0]))


def test_the_env_builds_its_masks_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.mdp.envs import small_env

    env = small_env(2, 3)
    env.reset()
    calls: list[int] = []
    build = MaskBuilder.build_numpy

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(MaskBuilder, "build_numpy", counting)
    _, masks = env.observe()
    assert len(calls) == 1
    for name, array in env._mask_arrays.items():  # the device masks are those arrays
        assert np.array_equal(getattr(masks, name).cpu().numpy(), array), name
