"""RolloutBuffer: per-env segments, rewards written late, one GAE for all envs."""

from __future__ import annotations

import pytest
import torch

from esper.contracts import ActionSchema
from esper.simic.buffer import RolloutBuffer
from esper.tamiyo.action_masks import ActionMasks

E, T, D, H = 3, 5, 6, 4
SCHEMA = ActionSchema(("s0", "s1"), ("a", "b", "c"))


def _buffer() -> RolloutBuffer:
    return RolloutBuffer(E, T, D, SCHEMA, (1, H), "cpu")


def _step(buf: RolloutBuffer, g: torch.Generator, start: bool = False) -> list[int]:
    masks = ActionMasks.all_legal(SCHEMA, (E,))
    hidden = (torch.randn(1, E, H, generator=g), torch.randn(1, E, H, generator=g))
    obs = torch.randn(E, D, generator=g)
    return buf.add(
        obs,
        obs * 2,
        torch.zeros(E, 4, dtype=torch.long),
        torch.randn(E, generator=g),
        torch.randn(E, generator=g),
        masks,
        hidden,
        start,
    )


def _fill(buf: RolloutBuffer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in range(T):
        pos = _step(buf, g, start=t == 0)
        buf.set_rewards(pos, torch.randn(E, generator=g), terminated=t == T - 1)


def test_invalidating_one_env_leaves_the_other_envs_advantages_unchanged() -> None:
    full = _buffer()
    _fill(full, seed=0)
    reference = full.finish(torch.zeros(E), 0.99, 0.95)
    ref_adv = reference.advantages.clone()

    buf = _buffer()
    _fill(buf, seed=0)
    buf.invalidate(1, from_step=2)  # env 1 rolled back to its step-2 snapshot
    batch = buf.finish(torch.full((E,), 7.0), 0.99, 0.95)

    for env in (0, 2):
        assert torch.equal(batch.advantages[env], ref_adv[env])
    assert batch.valid[1].tolist() == [True, True, False, False, False]
    # env 1's kept segment now ends in a truncation that bootstraps from the critic's 7.0.
    assert buf.truncated[1, 1] and not buf.terminated[1, 1]
    expected_last = buf.rewards[1, 1] + 0.99 * 7.0 - buf.values[1, 1]
    assert batch.advantages[1, 1].item() == pytest.approx(expected_last.item(), rel=1e-6)


def test_an_invalidated_env_rewrites_its_segment_while_the_others_stay_aligned() -> None:
    buf = _buffer()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _step(buf, g)
    buf.invalidate(0, from_step=1)
    positions = _step(buf, g)
    assert positions == [1, 3, 3]
    assert buf.pos == [2, 4, 4]


def test_finish_needs_a_transition_in_every_env() -> None:
    buf = _buffer()
    g = torch.Generator().manual_seed(2)
    _step(buf, g)
    buf.invalidate(2, from_step=0)
    with pytest.raises(ValueError, match=r"envs \[2\]"):
        buf.finish(torch.zeros(E), 0.99, 0.95)


def test_a_full_buffer_refuses_another_step() -> None:
    buf = _buffer()
    _fill(buf, seed=3)
    with pytest.raises(IndexError, match="full"):
        _step(buf, torch.Generator().manual_seed(0))


def test_invalidate_rejects_steps_beyond_the_cursor() -> None:
    buf = _buffer()
    _step(buf, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        buf.invalidate(0, from_step=3)


def test_stored_hidden_state_is_the_one_each_env_acted_from() -> None:
    buf = _buffer()
    masks = ActionMasks.all_legal(SCHEMA, (E,))
    h = torch.arange(E * H, dtype=torch.float32).view(1, E, H)
    buf.add(
        torch.zeros(E, D),
        torch.zeros(E, D),
        torch.zeros(E, 4, dtype=torch.long),
        torch.zeros(E),
        torch.zeros(E),
        masks,
        (h, -h),
        True,
    )
    assert torch.equal(buf.hidden_at(2, 0)[0], h[:, 2])
    assert torch.equal(buf.hidden_at(2, 0)[1], -h[:, 2])
