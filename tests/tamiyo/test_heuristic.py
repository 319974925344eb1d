"""HeuristicController: each rule, their priority, legality, no host reads, a real rollout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from esper.contracts import BlendMode, LifecycleOp, ObservationLayout, SeedStage
from esper.contracts.config_errors import ConfigError
from esper.contracts.rollout import StepBatch
from esper.host_reads import HostReadCounter
from esper.mdp.rollout import RolloutCollector
from esper.mdp.transitions import Cursors
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.heuristic import HeuristicConfig, HeuristicController
from esper.tamiyo.policy import OP, SLOT
from esper.tamiyo.stateless import STATE_SHAPE
from tests.mdp.envs import small_env
from tests.tamiyo.factories import SCHEMA, random_masks

LAYOUT = ObservationLayout(len(SCHEMA.slot_ids), len(SCHEMA.blueprint_names))
CONFIG = HeuristicConfig(
    prune_threshold=0.02,
    plateau_delta=0.01,
    max_germinate_fraction=0.5,
    blueprint_preference=("b2", "b1"),
    blend_mode=BlendMode.SIGMOID,
)
#: A clearly improving host early in the episode: only the rule under test fires.
IMPROVING = 0.05
EARLY = 0.1
N_RANDOM_ENVS = 2000


def make_controller(config: HeuristicConfig = CONFIG, **kwargs: object) -> HeuristicController:
    return HeuristicController(LAYOUT, SCHEMA, config, **kwargs)


def make_obs(n_envs: int = 1) -> torch.Tensor:
    """Every slot DORMANT, the host improving, early in the episode."""
    obs = torch.zeros(n_envs, LAYOUT.dim)
    obs[:, LAYOUT["val_acc_delta"].start] = IMPROVING
    obs[:, LAYOUT["epoch_fraction"].start] = EARLY
    for slot in range(LAYOUT.n_slots):
        set_stage(obs, slot, SeedStage.DORMANT)
    return obs


def set_stage(obs: torch.Tensor, slot: int, stage: SeedStage, env: int | None = None) -> None:
    rows = slice(None) if env is None else env
    block = LAYOUT[f"slot{slot}.stage"]
    obs[rows, block.start : block.stop] = 0.0
    obs[rows, block.start + int(stage)] = 1.0


def set_feature(obs: torch.Tensor, name: str, value: float) -> None:
    obs[:, LAYOUT[name].start] = value


def live_masks(stages: dict[int, SeedStage], n_envs: int = 1) -> ActionMasks:
    """Masks as the env's builder would give them for these slot stages (others DORMANT)."""
    masks = ActionMasks.all_legal(SCHEMA, (n_envs,))
    masks.slot[:, LifecycleOp.WAIT] = False
    for slot in range(LAYOUT.n_slots):
        live = slot in stages
        masks.slot[:, LifecycleOp.GERMINATE, slot] = not live
        masks.slot[:, LifecycleOp.ADVANCE, slot] = live
        masks.slot[:, LifecycleOp.PRUNE, slot] = live
    masks.op[:] = masks.slot.any(-1)
    masks.op[:, LifecycleOp.WAIT] = True
    return masks


def act(
    obs: torch.Tensor, masks: ActionMasks, controller: HeuristicController | None = None
) -> torch.Tensor:
    controller = controller or make_controller()
    hidden = controller.initial_state(obs.shape[0])
    return controller.act(obs, hidden, masks).actions


# ------------------------------------------------------------------ PRUNE
@pytest.mark.parametrize("stage", [SeedStage.BLENDING, SeedStage.HOLDING])
def test_prunes_a_blending_or_holding_seed_that_costs_more_than_the_threshold(
    stage: SeedStage,
) -> None:
    obs = make_obs()
    set_stage(obs, 1, stage)
    set_feature(obs, "slot1.contribution", -CONFIG.prune_threshold - 0.01)
    actions = act(obs, live_masks({1: stage}))
    assert actions[0, OP] == LifecycleOp.PRUNE
    assert actions[0, SLOT] == 1


@pytest.mark.parametrize(
    ("stage", "contribution"),
    [
        (SeedStage.TRAINING, -0.5),  # too early to judge: alpha is still 0
        (SeedStage.GERMINATED, -0.5),
        (SeedStage.BLENDING, -CONFIG.prune_threshold + 0.005),  # a small cost is tolerated
        (SeedStage.HOLDING, 0.1),
    ],
)
def test_does_not_prune_a_seed_too_young_to_judge_or_within_the_threshold(
    stage: SeedStage, contribution: float
) -> None:
    obs = make_obs()
    set_stage(obs, 0, stage)
    set_feature(obs, "slot0.contribution", contribution)
    actions = act(obs, live_masks({0: stage}))
    assert actions[0, OP] == LifecycleOp.ADVANCE  # the next rule, not PRUNE


def test_does_not_prune_where_the_mask_forbids_it() -> None:
    obs = make_obs()
    set_stage(obs, 0, SeedStage.HOLDING)
    set_feature(obs, "slot0.contribution", -0.5)
    masks = live_masks({0: SeedStage.HOLDING})
    masks.slot[:, LifecycleOp.PRUNE] = False
    masks.op[:, LifecycleOp.PRUNE] = False
    assert act(obs, masks)[0, OP] == LifecycleOp.ADVANCE


def test_prune_outranks_advance_and_germinate() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", 0.0)  # plateau: GERMINATE would fire too
    set_stage(obs, 0, SeedStage.TRAINING)
    set_stage(obs, 2, SeedStage.BLENDING)
    set_feature(obs, "slot2.contribution", -0.5)
    actions = act(obs, live_masks({0: SeedStage.TRAINING, 2: SeedStage.BLENDING}))
    assert actions[0, OP] == LifecycleOp.PRUNE
    assert actions[0, SLOT] == 2


# ---------------------------------------------------------------- ADVANCE
def test_advances_the_first_slot_whose_last_advance_was_not_refused() -> None:
    obs = make_obs()
    for slot in range(3):
        set_stage(obs, slot, SeedStage.TRAINING)
    set_feature(obs, "slot0.gate_refused", 1.0)
    actions = act(obs, live_masks(dict.fromkeys(range(3), SeedStage.TRAINING)))
    assert actions[0, OP] == LifecycleOp.ADVANCE
    assert actions[0, SLOT] == 1


def test_advances_a_germinated_seed_even_when_flagged_refused() -> None:
    obs = make_obs()
    set_stage(obs, 0, SeedStage.TRAINING)
    set_feature(obs, "slot0.gate_refused", 1.0)
    set_stage(obs, 2, SeedStage.GERMINATED)
    set_feature(obs, "slot2.gate_refused", 1.0)
    actions = act(obs, live_masks({0: SeedStage.TRAINING, 2: SeedStage.GERMINATED}))
    assert actions[0, OP] == LifecycleOp.ADVANCE
    assert actions[0, SLOT] == 2


def test_advance_outranks_germinate() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", 0.0)
    set_stage(obs, 2, SeedStage.TRAINING)
    actions = act(obs, live_masks({2: SeedStage.TRAINING}))
    assert actions[0, OP] == LifecycleOp.ADVANCE
    assert actions[0, SLOT] == 2


def test_a_refused_advance_is_retried_only_when_nothing_else_fires_and_retry_is_on() -> None:
    obs = make_obs(2)
    set_stage(obs, 0, SeedStage.TRAINING)
    set_feature(obs, "slot0.gate_refused", 1.0)
    obs[1, LAYOUT["val_acc_delta"].start] = 0.0  # env 1 has plateaued: GERMINATE wins
    masks = live_masks({0: SeedStage.TRAINING}, n_envs=2)
    retrying = act(obs, masks)
    assert retrying[:, OP].tolist() == [LifecycleOp.ADVANCE, LifecycleOp.GERMINATE]
    assert retrying[0, SLOT] == 0
    no_retry = make_controller(dataclasses.replace(CONFIG, retry_refused_advance=False))
    assert act(obs, masks, no_retry)[:, OP].tolist() == [LifecycleOp.WAIT, LifecycleOp.GERMINATE]


# -------------------------------------------------------------- GERMINATE
def test_germinates_on_a_plateau_with_the_preferred_blueprint_and_configured_blend() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", CONFIG.plateau_delta - 0.005)
    masks = live_masks({0: SeedStage.HOLDING})
    masks.slot[:, LifecycleOp.ADVANCE] = False  # nothing to advance
    masks.blueprint[:, 1, 2] = False  # the favourite does not fit slot 1
    op, slot, blueprint, blend = act(obs, masks)[0].tolist()
    assert op == LifecycleOp.GERMINATE
    assert slot == 1  # slot 0 is taken
    assert SCHEMA.blueprint_names[blueprint] == "b1"  # the second preference
    assert SCHEMA.blend_modes[blend] == BlendMode.SIGMOID


def test_falls_back_to_the_first_legal_blueprint_and_blend_when_no_preferred_one_is_legal() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", -0.01)  # falling accuracy counts as a plateau too
    masks = live_masks({})
    masks.blueprint[:, 0, 0:3] = False  # only b3 fits slot 0
    masks.blend[:, SCHEMA.blend_modes.index(BlendMode.SIGMOID)] = False
    masks.blend[:, 0] = False
    op, slot, blueprint, blend = act(obs, masks)[0].tolist()
    assert (op, slot) == (LifecycleOp.GERMINATE, 0)
    assert SCHEMA.blueprint_names[blueprint] == "b3"
    assert blend == 1


def test_skips_a_slot_where_no_blueprint_fits() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", 0.0)
    masks = live_masks({})
    masks.blueprint[:, 0] = False
    op, slot, blueprint, _ = act(obs, masks)[0].tolist()
    assert (op, slot) == (LifecycleOp.GERMINATE, 1)
    assert masks.blueprint[0, 1, blueprint]


@pytest.mark.parametrize(
    ("delta", "fraction"),
    [
        (CONFIG.plateau_delta + 0.01, EARLY),  # still improving
        (0.0, CONFIG.max_germinate_fraction + 0.1),  # too late to pay off
    ],
)
def test_waits_instead_of_germinating_while_improving_or_late(
    delta: float, fraction: float
) -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", delta)
    set_feature(obs, "epoch_fraction", fraction)
    assert act(obs, live_masks({}))[0, OP] == LifecycleOp.WAIT


def test_waits_when_only_wait_is_legal() -> None:
    obs = make_obs()
    set_feature(obs, "val_acc_delta", 0.0)
    masks = live_masks({})
    masks.slot[:] = False
    masks.op[:] = False
    masks.op[:, LifecycleOp.WAIT] = True
    assert act(obs, masks)[0, OP] == LifecycleOp.WAIT


# ------------------------------------------------------- legality, sync, API
def _row(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[torch.arange(len(index)), index]


def random_obs(n_envs: int, generator: torch.Generator) -> torch.Tensor:
    """Random stages, refusal flags, contributions, accuracy deltas and clock."""
    obs = torch.zeros(n_envs, LAYOUT.dim)
    obs[:, LAYOUT["val_acc_delta"].start] = torch.randn(n_envs, generator=generator) * 0.02
    obs[:, LAYOUT["epoch_fraction"].start] = torch.rand(n_envs, generator=generator)
    for slot in range(LAYOUT.n_slots):
        stages = torch.randint(len(SeedStage), (n_envs,), generator=generator)
        block = LAYOUT[f"slot{slot}.stage"]
        obs[:, block.start : block.stop] = torch.nn.functional.one_hot(stages, len(SeedStage))
        obs[:, LAYOUT[f"slot{slot}.contribution"].start] = (
            torch.randn(n_envs, generator=generator) * 0.05
        )
        obs[:, LAYOUT[f"slot{slot}.gate_refused"].start] = (
            torch.rand(n_envs, generator=generator) < 0.5
        ).float()
    return obs


@pytest.mark.parametrize("p_legal", [0.1, 0.5, 0.9])
def test_actions_are_legal_under_random_masks(p_legal: float) -> None:
    g = torch.Generator().manual_seed(int(p_legal * 100))
    masks = random_masks((N_RANDOM_ENVS,), g, p_legal=p_legal)
    actions = act(random_obs(N_RANDOM_ENVS, g), masks)
    op, slot, blueprint, blend = actions.unbind(-1)
    acts_on_slot = op != LifecycleOp.WAIT
    germinates = op == LifecycleOp.GERMINATE
    assert _row(masks.op, op).all()
    assert (_row(_row(masks.slot, op), slot) | ~acts_on_slot).all()
    assert (_row(_row(masks.blueprint, slot), blueprint) | ~germinates).all()
    assert (_row(masks.blend, blend) | ~germinates).all()
    # The draws reach every rule, so the checks above covered each op.
    assert set(op.tolist()) == {int(o) for o in LifecycleOp}


def test_acting_for_all_envs_makes_no_host_reads() -> None:
    g = torch.Generator().manual_seed(0)
    masks = random_masks((64,), g)
    obs = random_obs(64, g)
    controller = make_controller()
    hidden = controller.initial_state(64)
    with HostReadCounter() as counter:
        controller.act(obs, hidden, masks)
        controller.value(obs, hidden)
    assert counter.count == 0, counter.report()


def test_it_has_no_parameters_scores_zero_and_passes_the_state_through() -> None:
    controller = make_controller()
    assert list(controller.parameters()) == []
    hidden = controller.initial_state(3)
    assert all(tuple(s.shape) == (STATE_SHAPE[0], 3, STATE_SHAPE[1]) for s in hidden)
    result = controller.act(make_obs(3), hidden, live_masks({}, n_envs=3))
    assert result.hidden is hidden
    assert result.actions.dtype == torch.long and tuple(result.actions.shape) == (3, 4)
    for out in (
        result.log_prob,
        result.entropy,
        result.value,
        controller.value(make_obs(3), hidden),
    ):
        assert torch.equal(out, torch.zeros(3))


@pytest.mark.parametrize(
    "change",
    [
        {"prune_threshold": -0.1},
        {"prune_threshold": float("nan")},
        {"plateau_delta": float("inf")},
        {"max_germinate_fraction": 0.0},
        {"max_germinate_fraction": 1.5},
        {"blueprint_preference": ["b0"]},
        {"blueprint_preference": ("b0", "b0")},
        {"blend_mode": 7},
        {"retry_refused_advance": 1},
    ],
)
def test_config_rejects_invalid_values_naming_the_field(change: dict[str, object]) -> None:
    (field,) = change
    with pytest.raises(ConfigError, match=rf"^HeuristicConfig\.{field}: ") as info:
        HeuristicConfig(**change)
    assert info.value.key == field


def test_controller_rejects_a_config_or_layout_that_does_not_match_the_schema() -> None:
    with pytest.raises(ValueError, match="not in this schema"):
        make_controller(HeuristicConfig(blueprint_preference=("conv_light",)))
    with pytest.raises(ValueError, match="same host"):
        HeuristicController(ObservationLayout(2, 4), SCHEMA)


def test_act_rejects_observations_on_another_device_than_the_controller() -> None:
    controller = make_controller().to("meta")
    with pytest.raises(ValueError, match=r"\.to\(device\)"):
        act(make_obs(), live_masks({}), controller)


# ------------------------------------------------------------- integration
def test_it_drives_a_real_rollout_germinating_seeds_with_only_legal_ops() -> None:
    torch.manual_seed(0)
    env = small_env(n_envs=2, episode_epochs=4)
    controller = HeuristicController(env.layout, env.schema)
    # Raw observations, as run_episodes hands every controller but the learned policy.
    store = Cursors(env.n_envs, env.decisions_per_episode)
    collector = RolloutCollector(env, controller, store)
    steps: list[StepBatch] = []
    with HostReadCounter() as counter:
        summary = collector.collect(0, on_step=steps.append).summary
    # Only the collector's one read per host epoch: the controller adds none.
    assert counter.count == summary.packed_transfers == env.config.episode_epochs, counter.report()
    assert summary.seeds_germinated.sum() > 0
    assert not any(s.illegal.any() for s in steps)
