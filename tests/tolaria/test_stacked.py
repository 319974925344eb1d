"""The stacked engine: envs of one architecture trained as one mapped network, with the
per-env path's results up to float rounding.

Tolerance: after two epochs of three batches, every parameter, buffer and momentum
buffer within ``STATE_ATOL`` of the per-env path's and every epoch figure within
``FIGURE_ATOL`` (measured on the CNN envs below: 5.0e-7 and 2.4e-7): a stacked
convolution sums in another order, everything elementwise is the same arithmetic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from esper.contracts import BlendMode, SeedStage
from esper.contracts.config_errors import ConfigError
from esper.host_reads import HostReadCounter
from esper.kasmina import CNNHost, GrowingHost, TransformerHost
from esper.kasmina.optim import OptimConfig
from esper.kasmina.sgd import MOMENTUM_BUFFER
from esper.mdp.env_config import EnvConfig
from esper.tolaria import stack_grouping, stacked_plan, stacked_validation
from esper.tolaria import stacked as stacked_module
from esper.tolaria.accumulators import EnvAccumulator, accumulators, epoch_figures
from esper.tolaria.copies import Copies
from esper.tolaria.epoch import EpochResult, run_epoch
from esper.tolaria.host_training import HostTraining
from esper.tolaria.snapshot import HostSnapshot
from esper.tolaria.stack_grouping import stack_groups
from esper.tolaria.stacked import StackedGroup
from tests.ops import OpCounter
from tests.tolaria.grown import (
    FUZZ_BLUEPRINTS,
    TRANSFORMER_FUZZ_BLUEPRINTS,
    Grown,
    Plan,
    float64_default,
    grown_envs,
    planted,
)
from tests.tolaria.loaders import image_loaders, token_loaders
from tests.tolaria.stacking import count_stacked_steps
from tests.tolaria.test_epoch import FAST, PASS, to_stage

STATE_ATOL = 1e-5
FIGURE_ATOL = 1e-5
PER_ENV = HostTraining(cpu_workers=1)
STACKED = HostTraining(engine="stacked")


def cnn_envs() -> list[GrowingHost]:
    """Pairs of envs in every state a stacked step treats differently, and one alone:
    no seed; a residual seed in TRAINING (incubation); widening seeds BLENDING at
    different alphas, gated; a residual seed HOLDING; a merged widening; a lone
    widening in TRAINING."""
    torch.manual_seed(0)
    envs = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(11)]
    for env in envs[2:4]:
        env.germinate("stage0", "conv_light", BlendMode.LINEAR)
        to_stage(env, "stage0", SeedStage.TRAINING)
    for k, env in enumerate(envs[4:6]):
        env.germinate("stage1", "widen", BlendMode.GATED)
        to_stage(env, "stage1", SeedStage.BLENDING)
        for _ in range(k):
            env.model.slot("stage1").end_epoch()  # alpha 0.5, then 1
    for env in envs[6:8]:
        env.germinate("stage1", "depthwise", BlendMode.SIGMOID)
        to_stage(env, "stage1", SeedStage.HOLDING)
    for env in envs[8:10]:
        env.germinate("stage0", "widen", BlendMode.LINEAR)
        to_stage(env, "stage0", SeedStage.FOSSILIZED)
    envs[10].germinate("stage1", "widen", BlendMode.LINEAR)
    to_stage(envs[10], "stage1", SeedStage.TRAINING)
    return envs


def two_pairs() -> list[GrowingHost]:
    """Two groups of two: envs blending a gated widening in stage1, and envs holding a
    depthwise seed there."""
    made = cnn_envs()
    return made[4:8]


def on_cuda(make: Callable[[], list[GrowingHost]]) -> list[GrowingHost]:
    """``make()``'s envs with their hosts moved to the GPU (parameters keep their
    identity there, so the optimizers follow)."""
    made = make()
    for env in made:
        env.model.cuda()
    return made


def seed_flags(accs: list[EnvAccumulator]) -> list[list[bool]]:
    """Per env, whether each slot's trained seed kept finite gradients (as an epoch's
    ``seed_grads_finite`` reports them)."""
    return epoch_figures(accs, torch.device("cpu"))[3].tolist()


def assert_close_results(a: EpochResult, b: EpochResult, atol: float = FIGURE_ATOL) -> None:
    for name, value in a.as_dict().items():
        other = b.as_dict()[name]
        assert value.shape == other.shape, name
        torch.testing.assert_close(value.double(), other.double(), atol=atol, rtol=0)
    assert a.skipped_envs == b.skipped_envs
    assert a.train_predictions == b.train_predictions


def assert_close_states(
    a: list[GrowingHost], b: list[GrowingHost], atol: float = STATE_ATOL
) -> None:
    for i, (env_a, env_b) in enumerate(zip(a, b, strict=True)):
        state_b = env_b.model.state_dict()
        for name, value in env_a.model.state_dict().items():
            torch.testing.assert_close(
                value.double(), state_b[name].double(), atol=atol, rtol=0,
                msg=lambda m, i=i, name=name: f"env {i} {name}: {m}",
            )  # fmt: skip
        for opt_a, opt_b in zip(env_a.optimizers(), env_b.optimizers(), strict=True):
            # The same entries, none empty: they are what a checkpoint holds.
            assert opt_a.state_dict()["state"].keys() == opt_b.state_dict()["state"].keys()
            params_a = [p for g in opt_a.param_groups for p in g["params"]]
            params_b = [p for g in opt_b.param_groups for p in g["params"]]
            for p_a, p_b in zip(params_a, params_b, strict=True):
                buf_a = opt_a.state.get(p_a, {}).get(MOMENTUM_BUFFER)
                buf_b = opt_b.state.get(p_b, {}).get(MOMENTUM_BUFFER)
                assert (buf_a is None) == (buf_b is None), f"env {i}: momentum buffer presence"
                if buf_a is not None:
                    torch.testing.assert_close(buf_a, buf_b, atol=atol, rtol=0)


def run_both(
    make: Callable[[], list[GrowingHost]],
    loaders: tuple[DataLoader, DataLoader],
    epochs: int = 2,
    atol: tuple[float, float] = (FIGURE_ATOL, STATE_ATOL),
    **training: object,
) -> tuple[list[GrowingHost], list[GrowingHost]]:
    """Both engines' epochs from the same envs (``make``), their figures and then their
    states compared within ``atol`` (figures, states)."""
    per_env, stacked = make(), make()
    train, val = loaders
    for _ in range(epochs):
        a = run_epoch(per_env, train, val, HostTraining(cpu_workers=1, **training))
        b = run_epoch(stacked, train, val, HostTraining(engine="stacked", **training))
        assert_close_results(a, b, atol[0])
    assert_close_states(per_env, stacked, atol[1])
    return per_env, stacked


def test_envs_group_by_architecture_seeds_and_stages_but_not_alpha() -> None:
    """Envs 2 and 3 incubate the same seed, which the host's pass goes through: they
    train with the plain envs 0 and 1, and with envs 4 and 5, which blend a widening in
    at different alphas in stage1, and env 10, which incubates that widening (run at
    alpha 0 in the host's pass): no member runs both seeds, so the group's template is
    built (env 2's host with env 5's stage1). Envs 8 and 9 merged a widening into stage0,
    so their layers are wider: they cannot be padded beside 2 and 3, whose residual seed
    must match its slot's width. Envs 6 and 7 hold another seed in stage1."""
    envs = cnn_envs()
    groups, alone = stack_groups(envs)
    assert groups == [[0, 1, 2, 3, 4, 5, 10], [6, 7], [8, 9]]
    assert alone == []
    alphas = [envs[i].model.slot("stage1").alpha for i in (4, 5)]
    assert alphas[0] != alphas[1]


def test_a_stacked_epoch_validates_each_group_as_one_and_a_lone_env_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation figures of every group member equal the per-env path's (run_both, with
    seeds blending in at several slots, gates, padding, mixed slots, built templates);
    here: which envs validate on their own."""
    validated_alone: list[int] = []
    groups: list[int] = []
    per_env = stacked_validation.validate_with_counterfactuals
    sums = StackedGroup.validation_sums

    def alone(envs: list[GrowingHost], *args: object) -> object:
        validated_alone.extend(id(env) for env in envs)
        return per_env(envs, *args)

    def grouped(self: StackedGroup, *args: object) -> object:
        groups.append(self.size)
        return sums(self, *args)

    monkeypatch.setattr(stacked_validation, "validate_with_counterfactuals", alone)
    monkeypatch.setattr(StackedGroup, "validation_sums", grouped)
    apart = GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST), OptimConfig(host_lr=0.5))
    envs = [*cnn_envs(), apart]  # its own learning rate: no group
    train, val = image_loaders()
    run_epoch(envs, train, val, STACKED)
    # As they trained: 16 samples over 12 envs give envs 0-3 two each and the others one,
    # so the group of envs 0-5 and 10 trains as envs 0-3 and envs 4, 5, 10.
    assert sorted(groups) == [2, 2, 3, 4]
    assert validated_alone == [id(apart)]


def test_the_result_counts_the_samples_each_env_trained_stacked() -> None:
    envs = cnn_envs()
    train, val = image_loaders(n_train=88, batch=44)
    result = run_epoch(envs, train, val, STACKED)
    assert result.train_predictions == (8,) * 11
    assert result.stacked_predictions == (8,) * 11
    assert run_epoch(cnn_envs(), train, val, PER_ENV).stacked_predictions == (0,) * 11


def test_an_env_with_momentum_and_one_without_train_as_one_and_as_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Env 1's first step runs a row of zero momentum: ``0 * momentum + grad`` is the
    buffer torch starts (a copy of the gradient), and env 1 ends with its own buffers."""
    train, val = image_loaders()

    def envs() -> list[GrowingHost]:
        made = cnn_envs()[:2]
        run_epoch(made[:1], train, val, PER_ENV)  # env 0 now has momentum buffers
        return made

    made = envs()
    assert stack_groups(made) == ([[0, 1]], [])
    assert not any(opt.state for opt in made[1].optimizers())
    steps = count_stacked_steps(monkeypatch)
    _, stacked = run_both(envs, (train, val), epochs=1)
    assert steps and set(steps) == {2}
    assert all(opt.state for opt in stacked[1].optimizers())


def test_stacked_epochs_equal_the_per_env_path_for_cnn_seeds_in_every_stage() -> None:
    run_both(cnn_envs, image_loaders(n_train=128, batch=44))


def test_stacked_epochs_equal_the_per_env_path_for_transformer_hosts() -> None:
    def envs() -> list[GrowingHost]:
        torch.manual_seed(0)
        made = [
            GrowingHost(TransformerHost(seq_len=12, d_model=32, lifecycle=FAST)) for _ in range(4)
        ]
        for env in made[2:]:
            env.germinate("block1", "lora", BlendMode.LINEAR)
            to_stage(env, "block1", SeedStage.BLENDING)
        return made

    run_both(envs, token_loaders())


def test_a_seed_just_planted_gets_no_optimizer_state_from_a_stacked_epoch() -> None:
    """A GERMINATED seed is not trained yet: neither path may give it an optimizer
    state (not even an empty one: checkpoints would hold it)."""

    def envs() -> list[GrowingHost]:
        torch.manual_seed(0)
        made = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(2)]
        for env in made:
            env.germinate("stage1", "conv_light", BlendMode.LINEAR)
        return made

    _, stacked = run_both(envs, image_loaders(), epochs=1)
    for env in stacked:
        assert env.model.slot("stage1").stage is SeedStage.GERMINATED
        assert not env.seed_optimizers["stage1"].state_dict()["state"]


def planted_beside(stage: SeedStage) -> Callable[[], list[GrowingHost]]:
    """Two envs with a conv_light seed in stage1: env 0's just planted (GERMINATED, idle),
    env 1's in ``stage``. The idle seed's parameters bear the names of the rows the group
    runs for env 1's."""

    def envs() -> list[GrowingHost]:
        torch.manual_seed(0)
        made = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(2)]
        for env in made:
            env.germinate("stage1", "conv_light", BlendMode.LINEAR)
        to_stage(made[1], "stage1", stage)
        return made

    return envs


@pytest.mark.parametrize("stage", [SeedStage.TRAINING, SeedStage.BLENDING])
def test_a_seed_just_planted_where_the_template_trains_one_gets_no_state(
    stage: SeedStage,
) -> None:
    """The template's rows in the idle seed's place must not leave it a momentum buffer
    (the per-env path gives it none)."""
    envs = planted_beside(stage)
    assert stack_groups(envs()) == ([[0, 1]], [])
    _, stacked = run_both(envs, image_loaders(n_train=64, batch=16), epochs=1)
    assert not stacked[0].seed_optimizers["stage1"].state_dict()["state"]


def one_step_with_an_inf(
    pair: list[GrowingHost], row: int
) -> tuple[StackedGroup, list[EnvAccumulator]]:
    """``pair`` as a group, one step on random images with an inf in member ``row``'s,
    written back: the group and the members' accumulators."""
    for env in pair:
        env.model.train()
    accs = accumulators(pair)
    group = StackedGroup(pair, accs)
    x, y = torch.randn(2, 5, 1, 8, 8), torch.randint(0, 10, (2, 5))
    x[row, 0, 0, 0, 0] = float("inf")
    with torch.enable_grad():
        group.step(x, y)
    group.write_back()
    return group, accs


def test_a_steps_seed_gradient_checks_are_one_norm_op_whatever_the_seeds() -> None:
    """Every member's row of every trained seed gradient, its norm taken by one
    multi-tensor op (as each env's own step does), not a norm kernel per parameter."""
    envs = envs_with_idle_seeds()
    group_envs = [envs[0], envs[3]]  # both incubate stage1's seed
    for env in group_envs:
        env.model.train()
    group = StackedGroup(group_envs, accumulators(group_envs))
    assert len(group.plan.seed_names) > 1
    x, y = torch.randn(2, 5, 1, 8, 8), torch.randint(0, 10, (2, 5))
    with torch.enable_grad(), OpCounter() as ops:
        group.step(x, y)
    assert ops.ops["_foreach_norm"] == 1 and "linalg_vector_norm" not in ops.ops, ops.ops


def envs_with_idle_seeds() -> list[GrowingHost]:
    """Envs 0 and 2 have just planted a seed in stage0 (GERMINATED: the step leaves it
    alone), env 2's a gated widening; envs 0 and 3 incubate a seed in stage1 (TRAINING);
    env 1 is plain. So 0 groups with 3, and 2 with 1."""
    torch.manual_seed(0)
    made = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(4)]
    made[0].germinate("stage0", "conv_light", BlendMode.LINEAR)
    made[2].germinate("stage0", "widen", BlendMode.GATED)
    for env in (made[0], made[3]):
        env.germinate("stage1", "conv_light", BlendMode.LINEAR)
        to_stage(env, "stage1", SeedStage.TRAINING)
    return made


def test_a_seed_just_planted_does_not_keep_its_env_from_the_envs_with_an_empty_slot() -> None:
    envs = envs_with_idle_seeds()
    assert stack_groups(envs) == ([[0, 1, 2, 3]], [])
    idle = [copy.deepcopy(envs[i].model.slot("stage0").seed) for i in (0, 2)]
    _, stacked = run_both(envs_with_idle_seeds, image_loaders(n_train=64, batch=16))
    for i, before in zip((0, 2), idle, strict=True):
        seed = stacked[i].model.slot("stage0").seed
        assert seed is not None and before is not None
        for old, new in zip(before.state_dict().values(), seed.state_dict().values(), strict=True):
            assert torch.equal(old, new)  # not trained, as on the per-env path
        assert not stacked[i].seed_optimizers["stage0"].state_dict()["state"]


def test_an_idle_seed_keeps_its_place_in_its_envs_seed_gradient_flags() -> None:
    """Env 0 (the group's template) lists its idle stage0 seed's flags before its stage1
    seed's; env 3 lists only stage1's. A non-finite gradient in env 0's incubating seed
    lands on env 0's stage1 flags alone."""
    envs = envs_with_idle_seeds()
    _, accs = one_step_with_an_inf([envs[0], envs[3]], row=0)
    assert seed_flags(accs)[0] == [True, False]
    assert seed_flags(accs)[1] == [True, True]


def envs_with_and_without_gates() -> list[GrowingHost]:
    """Seeds whose forward multiplies by their gate where they have one (BlendMode.GATED):
    envs 0-2 blend a conv_light seed in stage1, env 1 gated; envs 3-4 hold a depthwise
    seed in stage0, env 4 gated; envs 5-6 have fossilized a conv_light seed in stage1,
    env 5 gated; envs 7-8 blend a widening in stage1, env 8 gated; envs 9-10 blend
    conv_light seeds in both slots, env 9 gated in stage0 only, env 10 in stage1 only."""
    plan: Plan = [
        [("stage1", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING)],
        [("stage1", "conv_light", BlendMode.GATED, SeedStage.BLENDING)],
        [("stage1", "conv_light", BlendMode.SIGMOID, SeedStage.BLENDING)],
        [("stage0", "depthwise", BlendMode.LINEAR, SeedStage.HOLDING)],
        [("stage0", "depthwise", BlendMode.GATED, SeedStage.HOLDING)],
        [("stage1", "conv_light", BlendMode.GATED, SeedStage.FOSSILIZED)],
        [("stage1", "conv_light", BlendMode.LINEAR, SeedStage.FOSSILIZED)],
        [("stage1", "widen", BlendMode.LINEAR, SeedStage.BLENDING)],
        [("stage1", "widen", BlendMode.GATED, SeedStage.BLENDING)],
        [
            ("stage0", "conv_light", BlendMode.GATED, SeedStage.BLENDING),
            ("stage1", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING),
        ],
        [
            ("stage0", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING),
            ("stage1", "conv_light", BlendMode.GATED, SeedStage.BLENDING),
        ],
    ]
    return planted(plan)


def test_envs_with_and_without_a_gate_group_where_one_member_has_every_gate() -> None:
    """Envs 0-2 blend a seed in stage1 (1 gated), 3 and 4 another in stage0 (4 gated): one
    group, run by env 1's host with env 4's stage0 (no member has both). Envs 9 and 10
    blend seeds in both slots, with gates in different ones: a group of their own, its
    template built the same way."""
    groups, alone = stack_groups(envs_with_and_without_gates())
    assert groups == [[0, 1, 2, 3, 4], [7, 8], [9, 10], [5, 6]]
    assert alone == []


def test_stacked_epochs_with_and_without_gates_equal_the_per_env_path() -> None:
    """Two epochs: in the second, the gated members' gates have momentum, the rows of the
    members without a gate do not."""
    _, stacked = run_both(envs_with_and_without_gates, image_loaders(n_train=132, batch=44))
    for i in (0, 2, 3, 6, 7):
        assert not any(".gate." in name for name, _ in stacked[i].model.named_parameters())


def test_a_member_without_a_gate_runs_the_templates_gate_as_one() -> None:
    """Env 1 (gated) is the group's template though listed second; a non-finite gradient
    in its seed lands on its own flags, not on env 0's."""
    envs = envs_with_and_without_gates()
    group, accs = one_step_with_an_inf([envs[0], envs[1]], row=1)
    assert group.template is envs[1].model
    assert seed_flags(accs)[0] == [True, True]
    assert seed_flags(accs)[1] == [True, False]


def test_a_group_no_member_of_which_runs_every_seed_runs_a_template_built_for_it() -> None:
    """Envs 9 and 10 gate different slots' seeds: no member's forward runs both gates,
    so the group's template is a copy of one member's host with the other's gated slot,
    and the group trains as its members would alone."""
    envs = envs_with_and_without_gates()[9:]
    group = StackedGroup(envs, accumulators(envs))
    assert all(group.template is not env.model for env in envs)
    assert [type(slot.gate) for slot in group.template.iter_slots()] == [
        type(envs[0].model.slot("stage0").gate),
        type(envs[1].model.slot("stage1").gate),
    ]
    run_both(lambda: envs_with_and_without_gates()[9:], image_loaders(n_train=64, batch=16))


def test_a_built_template_runs_the_gate_of_a_fossilized_seed_that_some_member_has() -> None:
    """Fossilized seeds with and without a gate share a key (the gate runs as 1 where
    missing). Env 0 has the most entries (a seed blending in), so the template is built
    from it; its fossilized seed has no gate, env 1's has one: the template takes env
    1's slot. A template without the gate failed in the forward (found in a real
    transformer fit)."""
    plan: Plan = [
        [
            ("stage1", "conv_light", BlendMode.LINEAR, SeedStage.FOSSILIZED),
            ("stage0", "depthwise", BlendMode.LINEAR, SeedStage.BLENDING),
        ],
        [("stage1", "conv_light", BlendMode.GATED, SeedStage.FOSSILIZED)],
    ]
    made = planted(plan)
    assert stack_groups(made) == ([[0, 1]], [])
    group = StackedGroup(made, accumulators(made))
    assert group.template.slot("stage1").gate is not None
    run_both(lambda: planted(plan), image_loaders(n_train=32, batch=16))


def test_gates_split_a_key_group_only_where_they_differ() -> None:
    a, b = ((4,), "lr 0.1, no buffer"), ((4,), "lr 0.1, a buffer")
    split = stack_grouping._split_by_optional
    assert split([0, 1, 2], [{}, {"g1": a}, {}]) == [[0, 1, 2]]
    assert split([0, 1, 2], [{"g1": a}, {"g1": b}, {}]) == [[0, 2], [1]]
    assert split([0, 1, 2], [{"g1": a}, {"g2": a}, {"g1": a, "g2": a}]) == [[0, 1, 2]]
    assert split([0, 1, 2], [{"g1": a}, {"g2": a}, {}]) == [[0, 1, 2]]


def envs_with_seeds_blending_in() -> list[GrowingHost]:
    """Seeds blending in (BLENDING, HOLDING), added at alpha on a detached input: env 0
    plain; 1 a conv_light seed in stage0; 2 the same and a gated widening in stage1; 3 a
    widening in stage1, holding; 4 and 5 a depthwise seed in stage0; 6 a widening
    incubating in stage1."""
    plan: Plan = [
        [],
        [("stage0", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING)],
        [
            ("stage0", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING),
            ("stage1", "widen", BlendMode.GATED, SeedStage.BLENDING),
        ],
        [("stage1", "widen", BlendMode.LINEAR, SeedStage.HOLDING)],
        [("stage0", "depthwise", BlendMode.LINEAR, SeedStage.BLENDING)],
        [("stage0", "depthwise", BlendMode.SIGMOID, SeedStage.HOLDING)],
        [("stage1", "widen", BlendMode.LINEAR, SeedStage.TRAINING)],
    ]
    return planted(plan)


def test_envs_with_seeds_blending_in_at_other_slots_group_under_one_that_has_them_all() -> None:
    """Env 2 has every seed of envs 0-3 and 6, which agree where they have one (6
    incubates the widening that 2 and 3 blend in); a seed of another blueprint in a slot
    (4, 5) splits."""
    assert stack_groups(envs_with_seeds_blending_in()) == ([[0, 1, 2, 3, 6], [4, 5]], [])


def test_stacked_epochs_with_seeds_blending_in_at_other_slots_equal_the_per_env_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two epochs: the members without a seed run the template's at alpha 0, so their
    hosts train as alone and they end with no seed and no seed state; env 6 incubates its
    widening, which the template blends in, as alone."""
    steps = count_stacked_steps(monkeypatch)
    _, stacked = run_both(envs_with_seeds_blending_in, image_loaders(n_train=126, batch=42))
    assert steps == [5, 2] * 3 * 2  # both groups, 3 batches, 2 epochs
    assert not stacked[0].seed_optimizers
    assert list(stacked[1].seed_optimizers) == ["stage0"]
    assert list(stacked[3].seed_optimizers) == ["stage1"]


def transformers_stack_as_one_group(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformer envs planted by ``plan`` form one group, which trains every step stacked
    and ends where the per-env path ends."""

    def envs() -> list[GrowingHost]:
        return planted(plan, lambda: TransformerHost(seq_len=12, d_model=32, lifecycle=FAST))

    assert stack_groups(envs()) == ([list(range(len(plan)))], [])
    steps = count_stacked_steps(monkeypatch)
    run_both(envs, token_loaders())
    assert steps and set(steps) == {len(plan)}


def test_transformer_envs_with_seeds_blending_in_at_other_blocks_equal_the_per_env_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Env 0 plain; 1 attention blending in block0; 2 the same and a gated widening in
    block1 (the template); 3 that widening, holding: one group, as alone."""
    plan: Plan = [
        [],
        [("block0", "attention", BlendMode.LINEAR, SeedStage.BLENDING)],
        [
            ("block0", "attention", BlendMode.LINEAR, SeedStage.BLENDING),
            ("block1", "widen", BlendMode.GATED, SeedStage.BLENDING),
        ],
        [("block1", "widen", BlendMode.LINEAR, SeedStage.HOLDING)],
    ]
    transformers_stack_as_one_group(plan, monkeypatch)


def envs_of_different_widths() -> list[GrowingHost]:
    """Env 0 plain; 1 merged a widening into stage0, 2 into stage1, 3 into both; 4 merged
    one into stage0 and blends another in at stage1 (the template: the only one running a
    seed); 5 incubates a widening at stage0, 6 blends one in there: seven widths of
    layers, every seed a widening."""
    return planted(
        [
            [],
            [("stage0", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED)],
            [("stage1", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED)],
            [
                ("stage0", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED),
                ("stage1", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED),
            ],
            [
                ("stage0", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED),
                ("stage1", "widen", BlendMode.GATED, SeedStage.BLENDING),
            ],
            [("stage0", "widen", BlendMode.LINEAR, SeedStage.TRAINING)],
            [("stage0", "widen", BlendMode.LINEAR, SeedStage.BLENDING)],
        ]
    )


def test_envs_whose_layers_merged_different_widenings_train_as_one_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A merged widening makes a stage's layers, and the next one's inputs, wider: envs
    that merged different ones train as one group, each padded with zeros to the widest,
    and end where the per-env path ends, at their own widths."""
    made = envs_of_different_widths()
    widths = {tuple(env.model.state_dict()["stages.1.body.0.weight"].shape) for env in made}
    assert len(widths) == 4  # stage1's first conv: two output and two input widths
    # 5 incubates, 6 blends in, a widening at stage0 where 1-4 merged one
    assert stack_groups(made) == ([[0, 1, 2, 3, 4, 5, 6]], [])
    steps = count_stacked_steps(monkeypatch)
    per_env, stacked = run_both(envs_of_different_widths, image_loaders(n_train=64, batch=35))
    assert steps and set(steps) == {7}
    for a, b in zip(per_env, stacked, strict=True):
        shapes = {name: t.shape for name, t in a.model.state_dict().items()}
        assert shapes == {name: t.shape for name, t in b.model.state_dict().items()}


def test_what_pads_a_narrower_member_stays_zero_through_a_stacked_step() -> None:
    """Why padding is exact: a zero-padded channel gets zero gradients, so after a step
    (weight decay and momentum included) every padded entry is still exactly zero."""
    envs = envs_of_different_widths()[:5]
    for env in envs:
        env.host_optimizer.param_groups[0]["weight_decay"] = 1e-3
    group = StackedGroup(envs, accumulators(envs))
    train, _ = image_loaders(n_train=40, batch=40)
    for x, y in train:
        x, y = x.view(5, 8, *x.shape[1:]), y.view(5, 8)
        group.step(x, y)
        group.step(x, y)  # the second moves momentum buffers the first made
    stacked = group._stacked
    assert stacked is not None
    buffers = {
        id(leaf): state["momentum_buffer"]
        for optimizer in stacked.optimizers
        for leaf, state in optimizer.state.items()
    }
    checked = 0
    for name, rows in stacked.params.items():
        for g in range(len(envs)):
            mine = group.plan.params[g].get(name)
            if mine is None or mine.shape == rows.shape[1:]:
                continue
            for tensor in (rows[g].detach(), buffers[id(rows)][g]):
                outside = torch.ones_like(tensor, dtype=torch.bool)
                outside[tuple(slice(0, n) for n in mine.shape)] = False
                assert tensor[outside].abs().max() == 0, f"env {g} {name}"
                checked += 1
    assert checked >= 10  # every narrower member's padded conv, norm and head tensors


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=5))
def test_padding_to_the_widest_shape_holds_each_member_and_gives_it_back(
    raw: list[list[int]],
) -> None:
    """Each member's tensor, stacked at the widest shape and cut back, is itself; what the
    padding added is zeros (and a member without the tensor a row of zeros); the widest
    shape is the smallest that holds every member."""
    dims = len(raw[0])
    shapes = [torch.Size((sizes * dims)[:dims]) for sizes in raw]
    widest = stacked_plan.widest(shapes)
    assert all(max(shape[d] for shape in shapes) == widest[d] for d in range(dims))
    tensors = [
        torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) + k + 1
        for k, shape in enumerate(shapes)
    ]
    copies = Copies()
    stacked = stacked_module._stacked_rows([*tensors, None], widest, tensors[0], copies)
    copies.run()
    assert stacked.shape == (len(shapes) + 1, *widest)
    for row, tensor in zip(stacked, tensors, strict=False):
        assert torch.equal(stacked_module._unpadded(row, tensor.shape), tensor)
        assert row.abs().sum() == tensor.abs().sum()  # only zeros added
    assert torch.equal(stacked[-1], torch.zeros(widest))


@given(st.integers(1, 12).flatmap(lambda g: st.lists(st.tuples(*[st.booleans()] * g))))
def test_a_groups_masks_are_its_patterns_rows_made_by_one_copy(
    patterns: list[tuple[bool, ...]],
) -> None:
    counter = OpCounter()
    with counter:
        masks = stacked_module._row_masks(patterns, torch.device("cpu"))
    assert masks.keys() == set(patterns)
    for pattern, rows in masks.items():
        assert rows.dtype == torch.bool and rows.tolist() == list(pattern)
    # One table from the host's list (an upload where the device is a GPU), rows as views:
    # no fills, no zeros.
    assert set(counter.ops) <= {"lift_fresh", "_to_copy", "unbind"}, counter.ops


def test_a_residual_seed_keeps_its_group_at_one_width() -> None:
    """A residual seed adds its output to its slot's activation, whose width it must match
    in every member: envs that run one only group with envs of their own widths."""
    plan: Plan = [
        [("stage1", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING)],
        [
            ("stage0", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED),
            ("stage1", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING),
        ],
        [("stage1", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING)],
    ]
    assert stack_groups(planted(plan)) == ([[0, 2]], [1])
    made = planted(plan)
    with pytest.raises(ValueError, match="different sizes and not every member pads exactly"):
        StackedGroup(made[:2], accumulators(made[:2]))


def test_transformer_hosts_of_different_widths_never_share_a_group() -> None:
    """A transformer normalises over its features: its layers are not padded."""
    plan: Plan = [[], [("block1", "widen", BlendMode.LINEAR, SeedStage.FOSSILIZED)], []]
    made = planted(plan, lambda: TransformerHost(seq_len=12, d_model=32, lifecycle=FAST))
    assert stack_groups(made) == ([[0, 2]], [1])


def test_a_member_incubating_the_seed_the_template_blends_in_trains_as_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Envs 1 and 3 incubate the seed env 0 blends in (a transformer's lora; the CNN's
    widenings, with their own norm statistics, are in the groups above): one group, the
    seed run at alpha 0 in the host's pass and 1 in the incubation pass for envs 1 and 3,
    whose seeds learn from that pass alone, as on their own."""
    plan: Plan = [
        [("block1", "lora", BlendMode.LINEAR, SeedStage.BLENDING)],
        [("block1", "lora", BlendMode.GATED, SeedStage.TRAINING)],
        [],
        [("block1", "lora", BlendMode.LINEAR, SeedStage.TRAINING)],
    ]
    transformers_stack_as_one_group(plan, monkeypatch)


def test_a_seed_just_planted_where_the_template_blends_one_keeps_its_flags() -> None:
    """Env 0 has just planted a seed in the slot where env 1 blends one in. A non-finite
    input to env 0 makes its loss non-finite, and its rows of env 1's seed with it; its
    own seed, which no pass ran, flags nothing."""
    group, accs = one_step_with_an_inf(planted_beside(SeedStage.BLENDING)(), row=0)
    assert group.template is group.envs[1].model
    assert seed_flags(accs)[0] == [True, True]
    assert seed_flags(accs)[1] == [True, True]
    assert not bool(accs[0].loss_finite) and bool(accs[1].loss_finite)


def envs_with_incubating_seeds() -> list[GrowingHost]:
    """Seeds in TRAINING, which the host's pass goes through: envs 0 and 4 plain; 1 a
    conv_light seed in stage1; 2 and 7 the same, gated; 3 a depthwise seed there; 5 and 8 a
    conv_light seed in stage0; 6 conv_light seeds in both slots."""
    torch.manual_seed(0)
    plan = [
        [],
        [("stage1", "conv_light", BlendMode.LINEAR)],
        [("stage1", "conv_light", BlendMode.GATED)],
        [("stage1", "depthwise", BlendMode.LINEAR)],
        [],
        [("stage0", "conv_light", BlendMode.LINEAR)],
        [("stage0", "conv_light", BlendMode.LINEAR), ("stage1", "conv_light", BlendMode.LINEAR)],
        [("stage1", "conv_light", BlendMode.GATED)],
        [("stage0", "conv_light", BlendMode.LINEAR)],
    ]
    made = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in plan]
    for env, seeds in zip(made, plan, strict=True):
        for slot_id, blueprint, mode in seeds:
            env.germinate(slot_id, blueprint, mode)
            to_stage(env, slot_id, SeedStage.TRAINING)
    return made


def test_envs_incubating_seeds_group_under_one_that_incubates_them_all() -> None:
    """A member's incubation pass runs the group's seeds in TRAINING in every slot, scaled
    by 0 where it lacks one: env 6, which incubates in both slots, runs the envs that
    incubate in either and the plain ones (a gate, which no pass in TRAINING runs, does
    not count); env 3 incubates another blueprint where others incubate conv_light."""
    groups, alone = stack_groups(envs_with_incubating_seeds())
    assert groups == [[0, 1, 2, 4, 5, 6, 7, 8]]
    assert alone == [3]


def test_stacked_epochs_with_incubating_and_plain_envs_equal_the_per_env_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two epochs: in the second, the incubating seeds have momentum, the rows of the
    plain members do not; the plain members end with no seed and no seed state, and the
    members incubating in one slot train their seed as alone."""
    steps = count_stacked_steps(monkeypatch)
    _, stacked = run_both(envs_with_incubating_seeds, image_loaders(n_train=135, batch=45))
    assert steps == [8] * 3 * 2  # one group, 3 batches, 2 epochs
    for i in (0, 4):
        assert not stacked[i].seed_optimizers
        assert not any(".seed." in name for name, _ in stacked[i].model.named_parameters())


def test_a_plain_member_of_an_incubating_group_keeps_its_own_flags() -> None:
    """The template (env 1, listed second) incubates; a non-finite input to the plain env
    0 makes its loss non-finite, and the seed rows it ran in the incubation pass, which
    are not its own, flag nothing of either env's."""
    envs = envs_with_incubating_seeds()
    group, accs = one_step_with_an_inf([envs[0], envs[1]], row=0)
    assert group.template is envs[1].model
    assert seed_flags(accs)[0] == [True, True]
    assert seed_flags(accs)[1] == [True, True]
    assert not bool(accs[0].loss_finite) and bool(accs[1].loss_finite)


def test_the_incubation_pass_scales_only_the_seeds_some_member_lacks() -> None:
    """Env 6 incubates in both slots, env 1 in stage1 only: the group's incubation pass
    scales the stage0 seed (0 on env 1's row) and adds the stage1 seed as it is; a step
    on its own (the per-env path) scales neither."""
    envs = envs_with_incubating_seeds()
    pair = [envs[1], envs[6]]
    for env in pair:
        env.model.train()
    group = StackedGroup(pair, accumulators(pair))
    seen: dict[str, list[bool]] = {"stage0": [], "stage1": []}
    for slot_id, record in seen.items():
        slot = group.template.slot(slot_id)
        slot.register_forward_pre_hook(
            lambda module, args, record=record: (
                record.append(module.scale_incubation) if module.incubating else None
            )
        )
    x, y = torch.randn(2, 5, 1, 8, 8), torch.randint(0, 10, (2, 5))
    with torch.enable_grad():
        group.step(x, y)
    assert seen == {"stage0": [True], "stage1": [False]}
    assert not group.template.slot("stage0").scale_incubation  # put back after the pass
    group.write_back()
    train, val = image_loaders(n_train=8, batch=8)
    run_epoch([envs[6]], train, val, PER_ENV)
    assert seen == {"stage0": [True, False], "stage1": [False, False]}


def test_groups_of_envs_apart_train_on_their_own_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Envs 0 and 2 blend a widening in stage1, 1 and 3 hold a depthwise seed there: each
    group gathers its members' rows."""
    steps = count_stacked_steps(monkeypatch)

    def envs() -> list[GrowingHost]:
        made = cnn_envs()
        return [made[4], made[6], made[5], made[7]]

    assert stack_groups(envs()) == ([[0, 2], [1, 3]], [])
    run_both(envs, image_loaders(n_train=64, batch=16))
    assert steps == [2] * (2 * 4 * 2)  # 2 groups, 4 batches, 2 epochs


def test_paired_groups_train_stacked_on_their_shared_share() -> None:
    run_both(lambda: cnn_envs()[:8], image_loaders(n_train=64, batch=16), paired_group=2)


def test_a_batch_whose_shares_differ_in_size_trains_alone_and_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """44 samples over 11 envs split evenly, 40 do not: envs 0-6 get 4, envs 7-10 get 3,
    so the groups of envs 4, 5, 8, 9 and of envs 6, 7 train that batch env by env, the
    group of envs 0-3 stacked."""
    steps = count_stacked_steps(monkeypatch)
    _, stacked = run_both(cnn_envs, image_loaders(n_train=84, batch=44), epochs=1)
    assert len(steps) == 3 + 1
    assert all(env.probe is not None and env.probe[0].shape[0] == 3 for env in stacked[7:])


def test_batches_that_split_unevenly_train_stacked_in_groups_of_one_share_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40 samples over 11 envs: envs 0-6 get 4, envs 7-10 get 3, in every batch. The
    group of envs 0-5 and 10 trains as envs 0-5 stacked and env 10 alone; the group of
    envs 6 and 7 as two lone envs; the group of envs 8 and 9 as it is."""
    assert stack_groups(cnn_envs()) == ([[0, 1, 2, 3, 4, 5, 10], [6, 7], [8, 9]], [])
    steps = count_stacked_steps(monkeypatch)
    _, stacked = run_both(cnn_envs, image_loaders(n_train=80, batch=40))
    assert steps == [6, 2] * 2 * 2  # 2 groups, 2 batches, 2 epochs
    assert [env.probe[0].shape[0] for env in stacked if env.probe is not None] == [4] * 7 + [3] * 4


#: How far float64 epochs of the two engines may end apart: float32 rounding, which a
#: stacked convolution's other order of sums leaves (up to about 1e-5 on a figure of 2.5,
#: where 1e-5 is the float32 tests' bound), shrinks to about 1e-15 in float64, while a
#: step that treats a member wrongly still moves it by far more.
FLOAT64_ATOL = 1e-9


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grown_envs())
def test_stacked_epochs_of_envs_grown_at_random_equal_the_per_env_path(case: Grown) -> None:
    """The scenarios above one at a time; here any mix of them: seeds of every CNN
    blueprint in every stage a step treats differently, at any slot, at different points
    of their ramps, widenings merged into some envs and not others, on even and uneven
    batches, paired or not. In float64, so that only rounding may part the engines."""
    with float64_default():
        run_both(case.envs, case.loaders(), atol=(FLOAT64_ATOL,) * 2, **case.training())


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grown_envs(transformer=True))
def test_stacked_epochs_of_transformers_grown_at_random_equal_the_per_env_path(
    case: Grown,
) -> None:
    """As for CNN hosts: seeds of every transformer blueprint, any mix, in float64."""
    with float64_default():
        run_both(case.envs, case.loaders(), atol=(FLOAT64_ATOL,) * 2, **case.training())


#: What the lifecycle property test draws for an env between epochs (None: nothing).
LIFECYCLE_OPS = ("plant", "advance", "advance", "prune", "snapshot", "restore", None)
#: Stages a seed advances or is pruned from (FOSSILIZED is final).
GROWING = frozenset(
    {SeedStage.GERMINATED, SeedStage.TRAINING, SeedStage.BLENDING, SeedStage.HOLDING}
)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda transformer: grown_envs(transformer)), st.data())
def test_stacked_epochs_with_lifecycle_ops_between_them_equal_the_per_env_path(
    case: Grown, data: st.DataObject
) -> None:
    """Envs grown at random (:func:`grown_envs`, CNN or transformer hosts), then between
    epochs the same drawn ops on both engines' envs, as a rollout's decisions make them
    (plant a seed of any blueprint and blend mode, advance one, prune one, snapshot the
    env or restore its snapshot, as the governor's rollback does), and every env's epoch
    end: groups form, split and re-form as the envs grow, and each epoch stacks from what
    the last one wrote back."""
    blueprints = TRANSFORMER_FUZZ_BLUEPRINTS if case.transformer else FUZZ_BLUEPRINTS
    train, val = case.loaders()
    with float64_default():
        per_env, stacked = case.envs(), case.envs()
        snapshots: dict[int, tuple[HostSnapshot, HostSnapshot]] = {}
        for epoch in range(4):
            a = run_epoch(per_env, train, val, HostTraining(cpu_workers=1, **case.training()))
            b = run_epoch(stacked, train, val, HostTraining(engine="stacked", **case.training()))
            assert_close_results(a, b, FLOAT64_ATOL)
            assert_close_states(per_env, stacked, FLOAT64_ATOL)
            for i, (mine, theirs) in enumerate(zip(per_env, stacked, strict=True)):
                slot_id = data.draw(st.sampled_from(mine.slot_ids))
                slot = mine.model.slot(slot_id)
                op = data.draw(st.sampled_from(LIFECYCLE_OPS))
                if op == "snapshot":
                    snapshots[i] = (
                        HostSnapshot.take(mine, epoch),
                        HostSnapshot.take(theirs, epoch),
                    )
                elif op == "restore" and i in snapshots:
                    for snapshot, env in zip(snapshots[i], (mine, theirs), strict=True):
                        snapshot.restore(env)
                elif op == "plant" and slot.stage is SeedStage.DORMANT:
                    blueprint = data.draw(st.sampled_from(blueprints))
                    mode = data.draw(st.sampled_from(list(BlendMode)))
                    for env in (mine, theirs):  # the same initial weights on both
                        torch.manual_seed(100 * epoch + i)
                        env.germinate(slot_id, blueprint, mode)
                elif op == "advance" and slot.stage in GROWING:
                    mine.advance(slot_id, PASS)
                    theirs.advance(slot_id, PASS)
                elif op == "prune" and slot.stage in GROWING:
                    mine.prune(slot_id)
                    theirs.prune(slot_id)
            for env in (*per_env, *stacked):
                env.end_epoch()


def test_a_member_blending_a_seed_in_sees_it_in_its_own_incubation_pass() -> None:
    """Env 0 incubates the seeds at both slots, env 1 blends stage0's in and incubates
    stage1's. Env 1's incubation pass sees stage0's seed at its alpha, as its own step
    does; at alpha 0 there (a mixed slot's cheaper path, exact only where no member
    blending the seed in incubates one), its stage1 seed learned from another input."""
    plan: Plan = [
        [
            ("stage0", "conv_light", BlendMode.LINEAR, SeedStage.TRAINING),
            ("stage1", "conv_light", BlendMode.LINEAR, SeedStage.TRAINING),
        ],
        [
            ("stage0", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING),
            ("stage1", "conv_light", BlendMode.LINEAR, SeedStage.TRAINING),
        ],
    ]
    assert stack_groups(planted(plan)) == ([[0, 1]], [])
    run_both(lambda: planted(plan), image_loaders(n_train=24, batch=8))


def test_masked_alphas_are_made_once_a_group_epoch_not_once_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixed slot (env 0 incubates stage0's seed, env 1 blends it in) masks its alpha
    for the host's pass and for the incubation pass; those change only between epochs,
    so each is made once a group epoch (validation reuses the host pass's), whatever
    the steps: 3 and 6 steps an epoch make the same two."""
    plan: Plan = [
        [("stage0", "conv_light", BlendMode.LINEAR, SeedStage.TRAINING)],
        [("stage0", "conv_light", BlendMode.LINEAR, SeedStage.BLENDING)],
    ]
    made: list[bool] = []
    real = stacked_module._masked_buffers

    def counting(stacked, buffers, incubating):  # type: ignore[no-untyped-def]
        made.append(incubating)
        return real(stacked, buffers, incubating)

    monkeypatch.setattr(stacked_module, "_masked_buffers", counting)
    for n_train in (24, 48):  # batches of 8: 3 and 6 steps
        made.clear()
        envs = planted(plan)
        assert stack_groups(envs) == ([[0, 1]], [])
        train, val = image_loaders(n_train=n_train, batch=8)
        run_epoch(envs, train, val, STACKED)
        assert made == [False, True]


def test_members_whose_shares_of_a_short_last_batch_are_empty_skip_it_as_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """40 samples in batches of 13 over 3 alike envs: env 0 takes 5 of each full batch,
    envs 1 and 2 take 4 and train stacked; the last batch's one sample is env 0's, so the
    group has no rows there and makes no step (a step on none would be NaN), as each of
    its envs alone skips an empty share; paired, every env skips the last batch's empty
    shares."""
    steps = count_stacked_steps(monkeypatch)
    run_both(lambda: cnn_envs()[:3], image_loaders(n_train=40, batch=13))
    assert steps == [2] * 3 * 2  # 3 full batches, 2 epochs
    steps.clear()
    run_both(lambda: cnn_envs()[:4], image_loaders(n_train=49, batch=16), paired_group=2)
    assert steps == [4] * 3 * 2  # shares 0, 1, 0 of 3 full batches, 2 epochs; share 1 of
    # the last batch's one sample is empty


def test_a_stacked_epoch_reads_nothing_on_the_host() -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    with HostReadCounter() as counter:
        result = run_epoch(envs, train, val, STACKED)
    assert counter.count == 0, counter.report()
    assert result.val_acc.shape == (len(envs),)


def test_a_stacked_step_of_cnn_hosts_writes_no_mapped_view_in_place() -> None:
    """An in-place op on a mapped activation (a view of the stacked one) makes autograd
    copy the slices it wrote back in every backward (``CopySlices``: a clone and copies,
    kernels on a GPU); the host's ReLUs run out of place while mapped, and are in place
    again after, as the per-env path runs them."""
    envs = cnn_envs()
    relus = [m for env in envs for m in env.model.modules() if isinstance(m, torch.nn.ReLU)]
    in_place = [relu for relu in relus if relu.inplace]
    assert in_place  # the stages' (a seed's are out of place)
    train, val = image_loaders()
    with OpCounter() as ops:
        result = run_epoch(envs, train, val, STACKED)
    assert sum(result.stacked_predictions) > 0
    assert "ConvolutionBackward0" in ops.backward_nodes  # the mode saw the backward passes
    assert not {"CopySlices", "AsStridedBackward0"} & ops.backward_nodes
    assert [relu for relu in relus if relu.inplace] == in_place


def test_a_group_out_of_memory_finishes_the_epoch_env_by_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"n": 0}
    real_step = StackedGroup.step

    def step_that_runs_out_once(self: StackedGroup, *args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second group's first batch
            raise torch.OutOfMemoryError("simulated")
        real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StackedGroup, "step", step_that_runs_out_once)
    run_both(two_pairs, image_loaders(n_train=64, batch=16), epochs=1)
    # 4 batches, 2 groups: the second stops stacking at its first; the first goes on.
    assert calls["n"] == 4 + 1


def test_a_group_out_of_memory_after_its_forward_retrains_the_batch_as_if_never_stacked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failed step's forward had moved the group's batch-norm statistics and its
    incubating seeds' own; its members retrain that batch alone, so those moves are
    undone first, or the batch would count twice."""
    calls = {"n": 0}
    real_sgd_step = stacked_module.sgd_step

    def sgd_step_that_runs_out_once(optimizers: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # the first group's second batch, forward and backward done
            raise torch.OutOfMemoryError("simulated")
        real_sgd_step(optimizers)  # type: ignore[arg-type]

    monkeypatch.setattr(stacked_module, "sgd_step", sgd_step_that_runs_out_once)
    run_both(two_pairs, image_loaders(n_train=64, batch=16), epochs=1)
    assert calls["n"] == 4 + 1 + 1  # group 2: 4 batches; group 1: 1 done, 1 failed


def test_a_parameter_that_never_learns_comes_back_without_a_momentum_buffer() -> None:
    """Stacking gives every parameter a momentum buffer, zeros where no member has one (so
    that a group's first step makes nothing and may be recorded: ``esper.tolaria.step_graph``),
    while an env's own step makes one with a parameter's first gradient: a parameter that
    gets none (frozen here) must come back without one, as from the per-env path, or
    every checkpoint would gain an entry. Those that learned come back with theirs."""

    def frozen_first() -> list[GrowingHost]:
        envs = cnn_envs()[:4]
        for env in envs:
            next(env.model.parameters()).requires_grad_(False)
        return envs

    _, stacked = run_both(frozen_first, image_loaders(), epochs=1)  # states compared there
    for env in stacked:
        first, *others = env.model.parameters()
        buffers = {
            p: opt.state.get(p, {}).get(MOMENTUM_BUFFER)
            for opt in env.optimizers()
            for p in opt.state
        }
        assert first not in buffers
        assert all(buffers.get(p) is not None for p in others if p.requires_grad and p in buffers)
        assert len(buffers) > 0


def test_write_back_puts_the_trained_tensors_and_sums_into_each_env() -> None:
    envs = cnn_envs()[2:4]  # a seed in TRAINING: both passes, seed flags
    for env in envs:
        env.model.train()
    accs = accumulators(envs)
    group = StackedGroup(envs, accs)
    before = [copy.deepcopy(env.model.state_dict()) for env in envs]
    x, y = torch.randn(2, 5, 1, 8, 8), torch.randint(0, 10, (2, 5))
    with torch.enable_grad():
        group.step(x, y)
    assert all(acc.seen == 0 for acc in accs)  # nothing lands before write_back
    group.write_back()
    for env, acc, old in zip(envs, accs, before, strict=True):
        assert acc.seen == 5
        assert float(acc.loss_sum) > 0
        seed = env.model.slot("stage0").seed
        assert seed is not None
        assert not torch.equal(seed.weight, old["slots.stage0.seed.weight"])  # incubation
        assert bool(acc.params_finite.all())
        assert env.probe is not None and env.probe[0].shape == (5, 1, 8, 8)
    group.write_back()  # a second write-back adds nothing
    assert [acc.seen for acc in accs] == [5, 5]


def test_stacked_needs_at_least_two_envs_and_shares_stacked_by_env() -> None:
    envs = cnn_envs()[:2]
    with pytest.raises(ValueError, match="at least 2 envs"):
        StackedGroup(envs[:1], accumulators(envs[:1]))
    group = StackedGroup(envs, accumulators(envs))
    with pytest.raises(ValueError, match=r"stacked \[2, \.\.\.\]"):
        group.step(torch.randn(3, 4, 1, 8, 8), torch.randint(0, 10, (3, 4)))


def test_bf16_autocast_trains_stacked_close_to_the_per_env_path() -> None:
    per_env, stacked = cnn_envs()[:4], cnn_envs()[:4]
    train, val = image_loaders()
    a = run_epoch(per_env, train, val, HostTraining(cpu_workers=1, amp="bf16"))
    b = run_epoch(stacked, train, val, HostTraining(engine="stacked", amp="bf16"))
    assert bool(b.loss_finite.all())
    # bf16 keeps 8 bits of mantissa: a loss agrees to its rounding, not to float32's.
    torch.testing.assert_close(a.train_loss, b.train_loss, atol=0.05, rtol=0)


@pytest.mark.parametrize(
    ("settings", "named"),
    [({"engine": "vmap"}, "per_env"), ({"engine": "stacked", "compile": True}, "compile=true"),
     ({"engine": "stacked", "amp": "fp16"}, "amp=fp16")],
)  # fmt: skip
def test_engine_settings_that_cannot_run_are_refused_by_name(
    settings: dict[str, object], named: str
) -> None:
    for config in (HostTraining, EnvConfig):
        with pytest.raises(ConfigError, match="engine") as caught:
            config(**settings)  # type: ignore[arg-type]
        assert named in str(caught.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "make",
    [
        cnn_envs,
        envs_with_idle_seeds,
        envs_with_and_without_gates,
        envs_with_incubating_seeds,
        envs_with_seeds_blending_in,
    ],
    ids=["every-stage", "idle-seeds", "gates", "incubating", "blending-in"],
)
def test_stacked_epochs_on_cuda_agree_with_the_per_env_path(
    make: Callable[[], list[GrowingHost]],
) -> None:
    # cuDNN picks other algorithms for a grouped convolution than for one env's. TF32 off
    # (torch's default for convolutions is on: up to 1.4e-2 apart on an H100), both paths
    # round in float32: at most 4.8e-7 apart there.
    per_env, stacked = on_cuda(make), on_cuda(make)
    train, val = image_loaders(n_train=128, batch=44)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for _ in range(2):
            a = run_epoch(per_env, train, val, PER_ENV)
            b = run_epoch(stacked, train, val, STACKED)
            torch.testing.assert_close(a.train_loss, b.train_loss, atol=1e-5, rtol=0)
            torch.testing.assert_close(a.val_loss, b.val_loss, atol=1e-5, rtol=0)
