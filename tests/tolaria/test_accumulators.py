"""An env's running sums over a host epoch (tolaria/accumulators.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import BlendMode
from esper.kasmina import CNNHost, GrowingHost
from esper.tolaria.accumulators import accumulators, epoch_figures, finite, seed_grad_norms
from tests.ops import OpCounter
from tests.tolaria.test_epoch import FAST


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_is_isfinite_at_the_edges(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    values = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, info.tiny / 4, math.inf,
         -math.inf, math.nan],
        dtype=dtype,
    )  # fmt: skip
    assert torch.equal(finite(values), torch.isfinite(values))


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=64))
def test_finite_is_isfinite_for_any_floats(values: list[float]) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(finite(tensor), torch.isfinite(tensor))


def _envs(n: int) -> list[GrowingHost]:
    """``n`` envs, every other one training a seed in stage0 (a seed optimizer)."""
    torch.manual_seed(0)
    envs = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(n)]
    for env in envs[1::2]:
        env.germinate("stage0", "conv_light", BlendMode.LINEAR)
    return envs


def test_the_envs_of_a_device_share_one_tensor_per_sum_each_writing_its_row() -> None:
    envs = _envs(3)
    accs = accumulators(envs)
    sums = accs[0].sums
    assert all(acc.sums is sums for acc in accs)
    assert [acc.row for acc in accs] == [0, 1, 2]
    accs[1].loss_sum.add_(2.5)
    accs[2].correct.add_(3)
    accs[0].loss_finite.logical_and_(torch.tensor(False))
    assert sums.loss_sum.tolist() == [0.0, 2.5, 0.0]
    assert sums.correct.tolist() == [0, 0, 3]
    assert sums.loss_finite.tolist() == [False, True, True]
    # Env 1 trains its seed's parameters; envs 0 and 2 train none.
    seed = list(envs[1].model.slot("stage0").seed_parameters())
    assert accs[1].seed_params == seed and not accs[0].seed_params and not accs[2].seed_params
    accs[1].params_finite[-1] = False
    assert sums.params_finite.tolist() == [True] * (len(seed) - 1) + [False]


def test_epoch_figures_are_each_envs_own_means_and_flags() -> None:
    envs = _envs(4)
    accs = accumulators(envs)
    for k, acc in enumerate(accs):
        acc.loss_sum.add_(torch.tensor(1.0) / 3 * (k + 1))
        acc.correct.add_(k)
        acc.seen = 7 * k  # env 0 saw nothing: its means divide by 1
    accs[3].params_finite[0] = False
    train_loss, train_acc, loss_finite, grads_finite = epoch_figures(accs, torch.device("cpu"))
    assert torch.equal(train_loss, torch.stack([a.loss_sum / max(a.seen, 1) for a in accs]))
    assert torch.equal(train_acc, torch.stack([a.correct / max(a.seen, 1) for a in accs]))
    assert loss_finite.tolist() == [True] * 4
    # Slot stage0 of env 3 got a non-finite gradient; stage1 trains nothing anywhere.
    assert grads_finite.tolist() == [[True, True], [True, True], [True, True], [False, True]]


def test_epoch_figures_come_back_in_env_order_from_sums_apart() -> None:
    """Envs on two devices have two sums; here two epochs' lists interleaved stand in."""
    first, second = accumulators(_envs(2)), accumulators(_envs(1))
    for acc, loss in zip(first + second, (1.0, 2.0, 3.0), strict=True):
        acc.loss_sum.add_(loss)
        acc.seen = 1
    mixed = [first[0], second[0], first[1]]
    train_loss, _, _, grads_finite = epoch_figures(mixed, torch.device("cpu"))
    assert train_loss.tolist() == [1.0, 3.0, 2.0]
    assert grads_finite.shape == (3, 2)


def test_epoch_figures_refuse_part_of_a_devices_accumulators() -> None:
    accs = accumulators(_envs(3))
    with pytest.raises(ValueError, match="every accumulator of a device's sums, in their order"):
        epoch_figures(accs[1:], torch.device("cpu"))


def _step_by_step(losses: list[float], corrects: list[int], counts: list[int]) -> tuple:
    """The sums as a check at every step makes them (the reference for ``settle``)."""
    loss_sum, correct, ok = torch.zeros(()), torch.zeros((), dtype=torch.long), True
    for loss, right, count in zip(losses, corrects, counts, strict=True):
        value = torch.tensor(loss)
        loss_sum.add_(value * count)
        correct.add_(right)
        ok = ok and bool(torch.isfinite(value))
    return loss_sum, correct, ok


@given(
    st.lists(
        st.tuples(
            st.floats(allow_nan=True, allow_infinity=True, width=32),
            st.integers(0, 16),
            st.integers(1, 16),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_settled_sums_equal_a_check_at_every_step(steps: list[tuple[float, int, int]]) -> None:
    losses, corrects, counts = (list(column) for column in zip(*steps, strict=True))
    acc = accumulators(_envs(1))[0]
    for loss, right, count in steps:
        acc.add_loss(torch.tensor(loss), count)
        acc.keep_step(torch.tensor(loss), torch.tensor(right), count)
    acc.settle()
    loss_sum, correct, ok = _step_by_step(losses, corrects, counts)
    assert torch.equal(acc.loss_sum, loss_sum) or (acc.loss_sum.isnan() and loss_sum.isnan())
    assert torch.equal(acc.correct, correct)
    assert bool(acc.loss_finite) is ok
    assert acc.seen == sum(counts)
    assert not acc.pending_losses and not acc.pending_correct  # settled once


def test_a_non_finite_gradient_at_any_step_flags_that_parameter_alone() -> None:
    envs = _envs(2)
    accs = accumulators(envs)
    acc = accs[1]  # trains its stage0 seed
    params = acc.seed_params
    assert len(params) >= 2
    for step in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        if step == 1:
            params[1].grad[0] = math.inf
        acc.pending_norms.extend(seed_grad_norms(acc))
    assert len(acc.pending_norms) == 3 * len(params)
    _, _, _, grads_finite = epoch_figures(accs, torch.device("cpu"))  # settles every env
    assert acc.params_finite.tolist() == [True] + [False] + [True] * (len(params) - 2)
    assert grads_finite.tolist() == [[True, True], [False, True]]


def test_a_steps_bookkeeping_is_three_ops_whatever_it_checks() -> None:
    """The loss sum (two ops) and one norm over every seed gradient; the finite checks and
    the correct count wait for the epoch's end."""
    acc = accumulators(_envs(2))[1]
    for p in acc.seed_params:
        p.grad = torch.ones_like(p)
    loss, correct = torch.tensor(0.5), torch.tensor(3)
    counter = OpCounter()
    with counter:
        acc.add_loss(loss, 16)
        acc.keep_step(loss, correct, 16)
        acc.pending_norms.extend(seed_grad_norms(acc))
    assert counter.ops == {"mul": 1, "add_": 1, "_foreach_norm": 1}, counter.ops


@functools.cache
def _seeded_envs() -> list[GrowingHost]:
    """Four envs training no seed, one, two, and the other one: runs of flags of every
    length, slots with and without a run, envs with and without one."""
    torch.manual_seed(0)
    envs = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(4)]
    for env, slots in zip(envs, ((), ("stage0",), ("stage0", "stage1"), ("stage1",)), strict=True):
        for slot in slots:
            env.germinate(slot, "conv_light", BlendMode.LINEAR)
    return envs


@given(st.data())
def test_a_slot_is_finite_where_every_flag_of_its_parameters_is(data: st.DataObject) -> None:
    accs = accumulators(_seeded_envs())
    flags = accs[0].sums.params_finite
    drawn = data.draw(st.lists(st.booleans(), min_size=flags.numel(), max_size=flags.numel()))
    flags.copy_(torch.tensor(drawn))
    _, _, _, grads_finite = epoch_figures(accs, torch.device("cpu"))
    expected = torch.ones(len(accs), accs[0].n_slots, dtype=torch.bool)
    for row, acc in enumerate(accs):
        for s, span in acc.seed_spans:
            expected[row, s] = bool(acc.params_finite[span].all())
    assert torch.equal(grads_finite, expected)


def test_epoch_figures_launch_as_many_ops_whatever_the_number_of_trained_seeds() -> None:
    one, many = accumulators(_envs(2)), accumulators(_seeded_envs())
    assert sum(len(acc.seed_spans) for acc in many) > sum(len(acc.seed_spans) for acc in one)
    counts = []
    for accs in (one, many):
        counter = OpCounter()
        with counter:
            epoch_figures(accs, torch.device("cpu"))
        counts.append(counter.ops)
    assert counts[0] == counts[1], counts
