"""leave_one_out: each env's advantage relative to the other envs' at the same step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.host_reads import HostReadCounter
from esper.mdp.pairing import group_size
from esper.simic.advantages import leave_one_out

EXAMPLES = 60


def reference(advantages: list[list[float]], valid: list[list[bool]]) -> list[list[float]]:
    """One env and one step at a time, on Python floats."""
    n_envs, steps = len(advantages), len(advantages[0])
    out = [row[:] for row in advantages]
    for e in range(n_envs):
        for t in range(steps):
            if not valid[e][t]:
                continue
            others = [advantages[o][t] for o in range(n_envs) if o != e and valid[o][t]]
            if others:
                out[e][t] = advantages[e][t] - sum(others) / len(others)
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda e: st.integers(1, 8).flatmap(
            lambda t: st.tuples(
                st.lists(
                    st.lists(st.floats(-10, 10, width=32), min_size=t, max_size=t),
                    min_size=e,
                    max_size=e,
                ),
                st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=e, max_size=e),
            )
        )
    )
)
def test_matches_the_per_env_per_step_reference(
    case: tuple[list[list[float]], list[list[bool]]],
) -> None:
    advantages, valid = case
    got = leave_one_out(torch.tensor(advantages, dtype=torch.float64), torch.tensor(valid))
    expected = torch.tensor(reference(advantages, valid), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


def test_a_shift_shared_by_every_env_cancels() -> None:
    """What all envs share at a step (the host's luck, the critic's error) leaves no trace."""
    g = torch.Generator().manual_seed(0)
    own = torch.randn(4, 10, generator=g)
    shared = 100.0 * torch.randn(1, 10, generator=g)
    valid = torch.ones(4, 10, dtype=torch.bool)
    assert torch.allclose(leave_one_out(own + shared, valid), leave_one_out(own, valid), atol=1e-4)


def test_envs_that_acted_alike_get_zero() -> None:
    same = torch.full((3, 5), 0.7)
    got = leave_one_out(same, torch.ones(3, 5, dtype=torch.bool))
    torch.testing.assert_close(got, torch.zeros(3, 5), rtol=0, atol=1e-6)


def test_reads_nothing_on_the_host() -> None:
    with HostReadCounter() as reads:
        leave_one_out(torch.randn(4, 6), torch.rand(4, 6) > 0.3)
    assert reads.count == 0


def test_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[E, T\]"):
        leave_one_out(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_each_group_is_its_own_leave_one_out(
    groups: int, group: int, steps: int, seed: int
) -> None:
    """Groups of consecutive envs: an env is compared with its own group only."""
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(groups * group, steps, generator=g, dtype=torch.float64)
    valid = torch.rand(groups * group, steps, generator=g) > 0.3
    got = leave_one_out(advantages, valid, group=group)
    expected = torch.cat(
        [
            leave_one_out(a, v)
            for a, v in zip(advantages.split(group), valid.split(group), strict=True)
        ]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_shift_shared_within_a_group_cancels_and_groups_do_not_mix() -> None:
    g = torch.Generator().manual_seed(1)
    own = torch.randn(6, 5, generator=g)
    shift = torch.cat([torch.full((3, 5), 50.0), torch.full((3, 5), -20.0)])
    valid = torch.ones(6, 5, dtype=torch.bool)
    assert torch.allclose(
        leave_one_out(own + shift, valid, group=3), leave_one_out(own, valid, group=3), atol=1e-4
    )
    # One group of six would not cancel the two groups' different shifts.
    assert not torch.allclose(leave_one_out(own + shift, valid), leave_one_out(own, valid))


def test_refuses_a_group_that_does_not_divide_the_envs() -> None:
    with pytest.raises(ValueError, match="group=4 must divide the 6 envs"):
        leave_one_out(torch.zeros(6, 3), torch.ones(6, 3, dtype=torch.bool), group=4)


@pytest.mark.parametrize(
    ("n_envs", "pair_size", "expected"), [(8, 4, 4), (4, 4, 4), (2, 4, 2), (8, None, 8)]
)
def test_group_size_is_pair_size_unless_fewer_envs(
    n_envs: int, pair_size: int | None, expected: int
) -> None:
    assert group_size(n_envs, pair_size) == expected


def test_group_size_refuses_envs_that_do_not_split_and_names_the_fix() -> None:
    with pytest.raises(ValueError, match="pair_size to null"):
        group_size(6, 4)
