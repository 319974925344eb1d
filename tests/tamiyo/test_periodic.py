"""The periodic control (tamiyo/periodic.py): its schedule, its choices, a real episode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from esper.contracts import ActionSchema, BlendMode, LifecycleOp, ObservationLayout, SeedStage
from esper.contracts.config_errors import ConfigError
from esper.host_reads import HostReadCounter
from esper.kasmina.lifecycle import LifecycleConfig
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.features import EnvState, ObservationBuilder, SlotState
from esper.tamiyo.heuristic import SCRIPTED_GROWTH, HeuristicConfig, HeuristicController
from esper.tamiyo.periodic import (
    epochs_to_fossilize,
    periodic_config,
    periodic_controller,
    periodic_schedule,
)
from esper.tamiyo.policy import BLUEPRINT, OP, SLOT
from tests.mdp.envs import small_env
from tests.tamiyo.factories import random_masks

#: The lifecycle of 2 training, 3 blending and 1 holding epochs (the defaults before
#: widening seeds): the schedule's arithmetic is pinned on it.
LONG = LifecycleConfig(min_training_epochs=2, blend_epochs=3, min_holding_epochs=1)
#: Every stage at its shortest: the clock still spends one epoch in each.
SHORTEST = LifecycleConfig(
    min_training_epochs=0, blend_epochs=1, min_holding_epochs=0, min_contribution=-1.0
)
EPISODE = 25
SCHEMA = ActionSchema(
    slot_ids=("stage0", "stage1", "stage2"),
    blueprint_names=("conv_light", "conv_heavy", "norm", "conv_wide"),
)
LAYOUT = ObservationLayout(len(SCHEMA.slot_ids), len(SCHEMA.blueprint_names))
N_RANDOM_ENVS = 2000


# ------------------------------------------------------------------ schedule
def test_a_2_3_1_lifecycle_plants_after_epochs_1_7_and_13() -> None:
    assert epochs_to_fossilize(LONG) == 7
    assert periodic_schedule(EPISODE, 3, LONG) == (1, 7, 13)


def test_the_default_schedule_plants_after_epochs_1_8_and_15() -> None:
    # 1 + 1 + 1 + 1 epochs to fossilize: window 1..20, shares of 20/3 from 1, 7.67, 14.33.
    assert epochs_to_fossilize(LifecycleConfig()) == 4
    assert periodic_schedule(EPISODE, 3, LifecycleConfig()) == (1, 8, 15)


def test_a_stage_whose_minimum_is_zero_still_takes_an_epoch() -> None:
    assert epochs_to_fossilize(SHORTEST) == 4
    assert epochs_to_fossilize(LifecycleConfig(2, 3, 1)) == 7
    assert epochs_to_fossilize(LifecycleConfig(4, 2, 3)) == 10


@pytest.mark.parametrize(
    ("episode_epochs", "n_slots", "lifecycle"),
    [
        (EPISODE, 1, LONG),
        (EPISODE, 2, LONG),
        (EPISODE, 4, LONG),
        (30, 3, LONG),
        (50, 5, LONG),
        (9, 1, LONG),
        (10, 2, LONG),
        (12, 3, SHORTEST),
        (40, 3, LifecycleConfig(4, 2, 3)),
        (100, 7, LONG),
    ],
)
def test_schedules_are_evenly_spaced_and_every_seed_can_fossilize_in_time(
    episode_epochs: int, n_slots: int, lifecycle: LifecycleConfig
) -> None:
    schedule = periodic_schedule(episode_epochs, n_slots, lifecycle)
    last_decision = episode_epochs - 1
    latest = last_decision - epochs_to_fossilize(lifecycle)
    window = latest  # plantable epochs 1..latest
    assert len(schedule) == n_slots
    assert schedule[0] == 1  # the first decision
    assert all(1 <= h <= latest for h in schedule)  # fossilizable by the last decision
    gaps = np.diff(schedule)
    assert all(g in (window // n_slots, -(-window // n_slots)) for g in gaps)  # even
    # Each planting at the first whole epoch of its share of the window.
    for i, h in enumerate(schedule):
        assert h - 1 >= i * window / n_slots > h - 2


@pytest.mark.parametrize("episode_epochs", [2, 3, 8])
def test_an_episode_too_short_for_a_seed_to_fossilize_plants_once_at_the_first_decision(
    episode_epochs: int,
) -> None:
    assert periodic_schedule(episode_epochs, 3, LONG) == (1,)
    assert periodic_schedule(9, 1, LONG) == (1,)  # the shortest in which one can


def test_a_window_shorter_than_the_slots_plants_once_per_epoch_of_it() -> None:
    assert periodic_schedule(10, 3, LONG) == (1, 2)
    assert periodic_schedule(11, 3, LONG) == (1, 2, 3)


@pytest.mark.parametrize(("episode_epochs", "n_slots"), [(0, 3), (25, 0), (25.0, 3), (25, True)])
def test_bad_lengths_and_slot_counts_raise_naming_them(
    episode_epochs: object, n_slots: object
) -> None:
    with pytest.raises(ConfigError, match=r"^(episode_epochs|n_slots): must be an int"):
        periodic_schedule(episode_epochs, n_slots, LONG)  # type: ignore[arg-type]


# ------------------------------------------------------------ configuration
def test_the_config_is_the_scripted_grower_s_preference_on_a_schedule() -> None:
    config = periodic_config(SCHEMA, EPISODE, LONG)
    assert config.blueprint_preference == ("conv_wide", "conv_heavy")  # mlp is not offered
    assert config.blend_mode == SCRIPTED_GROWTH.blend_mode
    assert config.germinate_at == (1 / 25, 7 / 25, 13 / 25)
    assert config.retry_refused_advance


@pytest.mark.parametrize(
    "germinate_at",
    [[0.1], (0.1, 0.1), (0.1, 0.10001), (-0.1,), (0.7,), (float("nan"),)],
)
def test_germinate_at_is_validated_naming_the_field(germinate_at: object) -> None:
    with pytest.raises(ConfigError, match=r"^HeuristicConfig\.germinate_at"):
        HeuristicConfig(germinate_at=germinate_at)  # type: ignore[arg-type]


# --------------------------------------------------------------- decisions
def observe(
    host_epoch: int,
    stages: dict[int, SeedStage] | None = None,
    refused: frozenset[int] = frozenset(),
    episode_epochs: int = EPISODE,
) -> torch.Tensor:
    """``[1, D]`` observation as the env builds its Python part (epoch_fraction in float32)."""
    stages = stages or {}
    builder = ObservationBuilder(LAYOUT, episode_epochs, param_budget=10_000, device="cpu")
    slots = [
        SlotState(
            stage=stages.get(s, SeedStage.DORMANT),
            epochs_in_stage=1,
            alpha=0.0,
            blueprint_index=None,
            gate_refused=s in refused,
        )
        for s in range(LAYOUT.n_slots)
    ]
    return torch.from_numpy(builder.host_part([EnvState(host_epoch, 0, slots)]))


def legal_masks(stages: dict[int, SeedStage]) -> ActionMasks:
    """Masks as the env's builder gives them: GERMINATE on DORMANT slots, ADVANCE and
    PRUNE on HOLDING ones."""
    masks = ActionMasks.all_legal(SCHEMA, (1,))
    masks.slot[:] = False
    for slot in range(LAYOUT.n_slots):
        stage = stages.get(slot, SeedStage.DORMANT)
        masks.slot[:, LifecycleOp.GERMINATE, slot] = stage is SeedStage.DORMANT
        masks.slot[:, LifecycleOp.ADVANCE, slot] = stage is SeedStage.HOLDING
        masks.slot[:, LifecycleOp.PRUNE, slot] = stage in (SeedStage.BLENDING, SeedStage.HOLDING)
    masks.op[:] = masks.slot.any(-1)
    masks.op[:, LifecycleOp.WAIT] = True
    return masks


def decide(
    controller: HeuristicController,
    host_epoch: int,
    stages: dict[int, SeedStage] | None = None,
    refused: frozenset[int] = frozenset(),
) -> list[int]:
    stages = stages or {}
    obs = observe(host_epoch, stages, refused)
    hidden = controller.initial_state(1)
    return controller.act(obs, hidden, legal_masks(stages)).actions[0].tolist()


def controller(episode_epochs: int = EPISODE) -> HeuristicController:
    return periodic_controller(LAYOUT, SCHEMA, episode_epochs, LONG)


@pytest.mark.parametrize("episode_epochs", [EPISODE, 30, 41])
def test_it_germinates_at_the_scheduled_epochs_and_no_others(episode_epochs: int) -> None:
    schedule = periodic_schedule(episode_epochs, LAYOUT.n_slots, LONG)
    control = controller(episode_epochs)
    hidden = control.initial_state(1)
    planted = []
    for h in range(1, episode_epochs):
        obs = observe(h, episode_epochs=episode_epochs)
        op, slot, blueprint, blend = control.act(obs, hidden, legal_masks({})).actions[0].tolist()
        if op == LifecycleOp.GERMINATE:
            planted.append(h)
            assert slot == 0  # the first free slot
            assert SCHEMA.blueprint_names[blueprint] == "conv_wide"
            assert SCHEMA.blend_modes[blend] == BlendMode.LINEAR
        else:
            assert op == LifecycleOp.WAIT
    assert tuple(planted) == schedule


def test_it_plants_in_the_first_free_slot_and_waits_when_none_is_free() -> None:
    control = controller()
    op, slot, _, _ = decide(control, 7, {0: SeedStage.BLENDING})
    assert (op, slot) == (LifecycleOp.GERMINATE, 1)
    op, slot, _, _ = decide(control, 13, {0: SeedStage.FOSSILIZED, 2: SeedStage.TRAINING})
    assert (op, slot) == (LifecycleOp.GERMINATE, 1)
    full = dict.fromkeys(range(3), SeedStage.TRAINING)
    assert decide(control, 13, full)[OP] == LifecycleOp.WAIT


def test_it_falls_back_to_the_next_preferred_blueprint_where_the_first_does_not_fit() -> None:
    control = controller()
    masks = legal_masks({})
    masks.blueprint[:, 0, SCHEMA.blueprint_names.index("conv_wide")] = False
    actions = control.act(observe(1), control.initial_state(1), masks).actions[0]
    assert SCHEMA.blueprint_names[int(actions[BLUEPRINT])] == "conv_heavy"


def test_it_fossilizes_whenever_advance_is_legal_retrying_refusals() -> None:
    control = controller()
    holding = {1: SeedStage.HOLDING}
    assert decide(control, 9, holding)[OP : SLOT + 1] == [LifecycleOp.ADVANCE, 1]
    assert decide(control, 10, holding, refused=frozenset({1}))[:2] == [LifecycleOp.ADVANCE, 1]


def test_a_scheduled_planting_outranks_a_fossilize_which_follows_next_epoch() -> None:
    control = controller()
    holding = {0: SeedStage.HOLDING}
    assert decide(control, 7, holding)[:2] == [LifecycleOp.GERMINATE, 1]
    assert decide(control, 8, holding)[:2] == [LifecycleOp.ADVANCE, 0]


def test_without_a_schedule_advance_still_outranks_germinate() -> None:
    config = HeuristicConfig(plateau_delta=2.0, blueprint_preference=("conv_wide",))
    plain = HeuristicController(LAYOUT, SCHEMA, config)
    assert decide(plain, 7, {0: SeedStage.HOLDING})[:2] == [LifecycleOp.ADVANCE, 0]


def random_obs(n_envs: int, generator: torch.Generator) -> torch.Tensor:
    """Random clock (on the episode's epochs), stages, refusals and contributions."""
    obs = torch.zeros(n_envs, LAYOUT.dim)
    epochs = torch.randint(1, EPISODE, (n_envs,), generator=generator)
    obs[:, LAYOUT["epoch_fraction"].start] = (epochs / EPISODE).float()
    obs[:, LAYOUT["val_acc_delta"].start] = torch.randn(n_envs, generator=generator) * 0.05
    for slot in range(LAYOUT.n_slots):
        stages = torch.randint(len(SeedStage), (n_envs,), generator=generator)
        block = LAYOUT[f"slot{slot}.stage"]
        obs[:, block.start : block.stop] = torch.nn.functional.one_hot(stages, len(SeedStage))
        obs[:, LAYOUT[f"slot{slot}.contribution"].start] = (
            torch.rand(n_envs, generator=generator) * 2 - 1
        )  # anywhere in [-1, 1]: a seed costing the whole accuracy included
        obs[:, LAYOUT[f"slot{slot}.gate_refused"].start] = (
            torch.rand(n_envs, generator=generator) < 0.5
        ).float()
    return obs


def test_it_never_prunes_and_only_acts_legally_under_random_masks() -> None:
    g = torch.Generator().manual_seed(0)
    masks = random_masks((N_RANDOM_ENVS,), g, p_legal=0.7, schema=SCHEMA)
    control = controller()
    actions = control.act(random_obs(N_RANDOM_ENVS, g), control.initial_state(N_RANDOM_ENVS), masks)
    op, slot, blueprint, _ = actions.actions.unbind(-1)
    rows = torch.arange(N_RANDOM_ENVS)
    assert not (op == LifecycleOp.PRUNE).any()
    assert masks.op[rows, op].all()
    assert (masks.slot[rows, op, slot] | (op == LifecycleOp.WAIT)).all()
    germinates = op == LifecycleOp.GERMINATE
    assert (masks.blueprint[rows, slot, blueprint] | ~germinates).all()
    assert set(op.tolist()) == {LifecycleOp.WAIT, LifecycleOp.GERMINATE, LifecycleOp.ADVANCE}


def test_it_is_deterministic() -> None:
    g = torch.Generator().manual_seed(1)
    masks = random_masks((256,), g, schema=SCHEMA)
    obs = random_obs(256, g)
    first, second = controller(), controller()
    a = first.act(obs, first.initial_state(256), masks).actions
    b = first.act(obs.clone(), first.initial_state(256), masks).actions
    c = second.act(obs, second.initial_state(256), masks, deterministic=False).actions
    assert torch.equal(a, b) and torch.equal(a, c)


def test_acting_for_all_envs_makes_no_host_reads() -> None:
    g = torch.Generator().manual_seed(2)
    masks = random_masks((64,), g, schema=SCHEMA)
    obs = random_obs(64, g)
    control = controller()
    hidden = control.initial_state(64)
    with HostReadCounter() as counter:
        control.act(obs, hidden, masks)
        control.value(obs, hidden)
    assert counter.count == 0, counter.report()


# ------------------------------------------------------------- a real episode
@pytest.mark.parametrize(
    ("episode_epochs", "lifecycle"),
    [
        (10, SHORTEST),
        (12, LifecycleConfig(min_training_epochs=2, blend_epochs=1, min_contribution=-1.0)),
        (EPISODE, LifecycleConfig(min_contribution=-1.0)),
    ],
    ids=["shortest", "training_2", "defaults"],
)
def test_in_a_real_episode_it_plants_on_schedule_and_fossilizes_every_seed_in_time(
    episode_epochs: int, lifecycle: LifecycleConfig
) -> None:
    """The env's own clock and masks: each seed fossilizes exactly
    ``epochs_to_fossilize`` decisions after its planting (the gate passes any
    contribution above -1), before the episode ends."""
    torch.manual_seed(0)
    env = small_env(n_envs=1, episode_epochs=episode_epochs, lifecycle=lifecycle)
    schedule = periodic_schedule(episode_epochs, env.n_slots, lifecycle)
    control = periodic_controller(env.layout, env.schema, episode_epochs, lifecycle)
    env.reset()
    events = []
    for _ in range(env.decisions_per_episode):
        obs, masks = env.observe()
        actions = control.act(obs, control.initial_state(1), masks).actions
        outcome = env.apply(actions.numpy(), env.metrics().numpy())
        assert not outcome.illegal.any()
        events += env.drain_events()
        env.train_epoch()
    planted = [(e.host_epoch, e.slot) for e in events if e.kind == "germinated"]
    fossilized = [(e.host_epoch, e.slot) for e in events if e.kind == "fossilized"]
    assert planted == [(h, slot) for h, slot in zip(schedule, env.slot_ids, strict=True)]
    needed = epochs_to_fossilize(lifecycle)
    assert fossilized == [(h + needed, slot) for h, slot in planted]
    assert all(h < episode_epochs for h, _ in fossilized)
    assert not [e for e in events if e.kind == "pruned"]
