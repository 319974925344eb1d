"""Shares of a batch: a stacked group's ``[G, ...]`` shares are its members' own."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.tolaria.shares import consecutive, env_share, group_shares, index_on


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, int, list[int], int | None]:
    n_envs = draw(st.integers(2, 9))
    batch = draw(st.integers(n_envs, 4 * n_envs + 3))
    b = draw(st.integers(0, 5))
    members = sorted(draw(st.sets(st.integers(0, n_envs - 1), min_size=2)))
    divisors = [k for k in range(1, n_envs + 1) if n_envs % k == 0]
    paired = draw(st.one_of(st.none(), st.sampled_from(divisors)))
    return n_envs, batch, b, members, paired


@settings(max_examples=150, deadline=None)
@given(cases())
def test_group_shares_are_the_members_env_shares_or_none_where_sizes_differ(
    case: tuple[int, int, int, list[int], int | None],
) -> None:
    n_envs, size, b, members, paired = case
    batch = (torch.arange(size * 2.0).view(size, 2), torch.arange(size))
    own = [env_share(batch, b, i, n_envs, paired) for i in members]
    rows = None if consecutive(members) else index_on(torch.device("cpu"), members)
    stacked = group_shares(batch, b, members, rows, n_envs, paired)
    if len({x.shape[0] for x, _ in own}) > 1:
        assert stacked is None
        return
    assert stacked is not None
    assert torch.equal(stacked[0], torch.stack([x for x, _ in own]))
    assert torch.equal(stacked[1], torch.stack([y for _, y in own]))


def test_consecutive_envs_are_one_run() -> None:
    assert consecutive([2, 3, 4]) and consecutive([5])
    assert not consecutive([0, 2]) and not consecutive([1, 2, 4])
