"""Cursors keep each env's place exactly as the PPO buffer does, without its tensors
(mdp/transitions.py): evaluation's rollouts stay exact with no transition kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.contracts import ActionSchema
from esper.mdp.transitions import Cursors
from esper.simic.buffer import RolloutBuffer
from esper.tamiyo.action_masks import ActionMasks

E, T, D = 3, 6, 4
SCHEMA = ActionSchema(("s0", "s1"), ("a", "b"))


def _add(store: RolloutBuffer | Cursors, active: list[bool], start: bool) -> list[int]:
    return store.add(
        torch.zeros(E, D),
        torch.zeros(E, D),
        torch.zeros(E, 4, dtype=torch.long),
        torch.zeros(E),
        torch.zeros(E),
        ActionMasks.all_legal(SCHEMA, (E,)),
        (torch.zeros(1, E, 2), torch.zeros(1, E, 2)),
        start,
        active=active,
    )


#: One operation: ("add", active flags) or ("drop", env, from-step fraction, keep?).
OPS = st.one_of(
    st.tuples(st.just("add"), st.lists(st.booleans(), min_size=E, max_size=E)),
    st.tuples(st.just("drop"), st.integers(0, E - 1), st.floats(0, 1), st.booleans()),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OPS, max_size=12))
def test_cursors_follow_the_buffer_through_adds_and_restores(ops: list[tuple]) -> None:
    buffer = RolloutBuffer(E, T, D, SCHEMA, (1, 2), "cpu")
    cursors = Cursors(E, T)
    for i, op in enumerate(ops):
        if op[0] == "add":
            if any(p >= T for p, a in zip(cursors.pos, op[1], strict=True) if a):
                continue  # a full env: the loop never writes past the episode
            assert _add(cursors, op[1], i == 0) == _add(buffer, op[1], i == 0)
        else:
            _, env, fraction, keep = op
            start = int(fraction * cursors.pos[env])
            kept = cursors.pos[env] - 1 if keep and cursors.pos[env] > start else None
            assert cursors.invalidate(env, start, kept) == buffer.invalidate(env, start, kept)
        assert cursors.pos == buffer.pos


def test_cursors_refuse_what_the_buffer_refuses() -> None:
    cursors = Cursors(E, 2)
    for _ in range(2):
        _add(cursors, [True] * E, False)
    with pytest.raises(IndexError, match="already holds its 2 steps"):
        _add(cursors, [True, False, False], False)
    with pytest.raises(ValueError, match=r"from a step in \[0, 2\]"):
        cursors.invalidate(0, 3)
    with pytest.raises(ValueError, match=r"kept transition must lie in \[1, 2\)"):
        cursors.invalidate(0, 1, keep=0)
    with pytest.raises(IndexError, match="out of range"):
        cursors.invalidate(E, 0)
