"""Shares of a batch: a stacked group's ``[G, ...]`` shares are its members' own."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.tolaria.shares import by_share_size, consecutive, env_share, group_shares, index_on


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


@st.composite
def groupings(draw: st.DrawFn) -> tuple[int, int, list[list[int]], int | None]:
    n_envs = draw(st.integers(2, 12))
    batch = draw(st.integers(1, 4 * n_envs + 3))
    envs = draw(st.permutations(range(n_envs)))
    cuts = sorted(draw(st.sets(st.integers(1, n_envs - 1), max_size=n_envs - 1)))
    groups = [sorted(envs[a:b]) for a, b in zip([0, *cuts], [*cuts, n_envs], strict=True)]
    divisors = [k for k in range(1, n_envs + 1) if n_envs % k == 0]
    paired = draw(st.one_of(st.none(), st.sampled_from(divisors)))
    return n_envs, batch, groups, paired


@settings(max_examples=200, deadline=None)
@given(groupings(), st.integers(2, 3))
def test_groups_split_by_share_size_stack_every_batch_of_that_size(
    case: tuple[int, int, list[list[int]], int | None], fewest: int
) -> None:
    """Every part's members have shares of one size, none empty, so group_shares stacks
    them; every env is in one part or alone; a part is never smaller than ``fewest``, and
    where every share has one size the groups stay as they were."""
    n_envs, size, groups, paired = case
    batch = (torch.arange(size * 2.0).view(size, 2), torch.arange(size))
    groups = [g for g in groups if len(g) >= fewest]
    parts, alone = by_share_size(groups, size, n_envs, paired, fewest)

    assert sorted([*alone, *(i for part in parts for i in part)]) == sorted(
        i for g in groups for i in g
    )
    for part in parts:
        assert len(part) >= fewest and any(set(part) <= set(g) for g in groups)
        shares = [env_share(batch, 0, i, n_envs, paired)[0].shape[0] for i in part]
        assert len(set(shares)) == 1 and shares[0] > 0, (part, shares)
        rows = None if consecutive(part) else index_on(torch.device("cpu"), part)
        assert group_shares(batch, 0, part, rows, n_envs, paired) is not None
    sizes = {env_share(batch, 0, i, n_envs, paired)[0].shape[0] for i in range(n_envs)}
    if len(sizes) == 1:
        assert parts == groups and alone == []
