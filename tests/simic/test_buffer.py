"""RolloutBuffer: per-env segments, rewards written late, one GAE for all envs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.contracts import ActionSchema
from esper.simic.buffer import RolloutBuffer
from esper.simic.ppo_batch import PPOBatch
from esper.tamiyo.action_masks import ActionMasks

E, T, D, H = 3, 5, 6, 4
SCHEMA = ActionSchema(("s0", "s1"), ("a", "b", "c"))


def _buffer() -> RolloutBuffer:
    return RolloutBuffer(E, T, D, SCHEMA, (1, H), "cpu")


def _step(
    buf: RolloutBuffer, g: torch.Generator, start: bool = False, active: list[bool] | None = None
) -> list[int]:
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
        active,
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


def _snapshot(buf: RolloutBuffer, env: int, pos: int) -> dict[str, torch.Tensor]:
    """Every stored field of ``env``'s transition at ``pos``, cloned."""
    names = ("obs", "raw_obs", "actions", "log_probs", "values", "rewards", "hidden_h")
    out = {name: getattr(buf, name)[env, pos].clone() for name in names}
    out |= {f"mask_{m}": getattr(buf.masks, m)[env, pos].clone() for m in ("op", "slot")}
    out["hidden_c"] = buf.hidden_c[env, pos].clone()
    return out


def _random_masks_step(
    buf: RolloutBuffer, g: torch.Generator, active: list[bool] | None = None
) -> list[int]:
    """A step whose masks differ per env, so a moved transition's masks can be told apart."""
    masks = ActionMasks.all_legal(SCHEMA, (E,))
    masks.op[:] = torch.rand(masks.op.shape, generator=g) < 0.5
    masks.slot[:] = torch.rand(masks.slot.shape, generator=g) < 0.5
    hidden = (torch.randn(1, E, H, generator=g), torch.randn(1, E, H, generator=g))
    obs = torch.randn(E, D, generator=g)
    return buf.add(
        obs,
        obs * 2,
        torch.randint(0, 2, (E, 4), generator=g),
        torch.randn(E, generator=g),
        torch.randn(E, generator=g),
        masks,
        hidden,
        False,
        active=active,
    )


def test_a_kept_transition_moves_whole_to_the_first_dropped_position_flagged_a_restart() -> None:
    buf = _buffer()
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        pos = _random_masks_step(buf, g)
        buf.set_rewards(pos, torch.randn(E, generator=g), terminated=False)
    panicked = _snapshot(buf, 1, 3)
    other = _snapshot(buf, 0, 1)
    # env 1 restored to a snapshot at position 1: positions 1 and 2 go, the transition
    # at 3 (whose epoch panicked) is kept at 1.
    assert buf.invalidate(1, from_step=1, keep=3) == 2
    assert buf.pos == [4, 2, 4]
    for name, value in _snapshot(buf, 1, 1).items():
        assert torch.equal(value, panicked[name]), name
    for name, value in _snapshot(buf, 0, 1).items():
        assert torch.equal(value, other[name]), name
    assert buf.valid[1].tolist() == [True, True, False, False, False]
    assert buf.hidden_restarts[1].tolist() == [False, True, False, False, False]
    # The env's next step, acting from the restored state, is flagged too; nobody else's.
    assert _random_masks_step(buf, g) == [4, 2, 4]
    assert buf.hidden_restarts.tolist() == [
        [False] * 5,
        [False, True, True, False, False],
        [False] * 5,
    ]
    # A later step of that env follows its predecessor again.
    assert _random_masks_step(buf, g, active=[False, True, False]) == [-1, 3, -1]
    assert not buf.hidden_restarts[1, 3]
    buf.reset()
    assert not buf.hidden_restarts.any()


def test_the_kept_transition_bootstraps_from_the_value_of_the_step_after_it() -> None:
    gamma, lam = 0.9, 0.8
    buf = _buffer()
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        pos = _step(buf, g)
        buf.set_rewards(pos, torch.randn(E, generator=g), terminated=False)
    buf.invalidate(2, from_step=1, keep=3)
    pos = _step(buf, g)  # env 2's first step from the restored state, at position 2
    buf.set_rewards(pos, torch.randn(E, generator=g), terminated=False)
    bootstrap = torch.randn(E, generator=g)
    batch = buf.finish(bootstrap, gamma, lam)
    r, v = buf.rewards[2], buf.values[2]
    # Env 2's kept segment, 0 -> kept (1) -> post-restore (2), bootstraps from the critic.
    next_v = torch.stack([v[1], v[2], bootstrap[2]])
    deltas = r[:3] + gamma * next_v - v[:3]
    expected = torch.zeros(3)
    running = torch.zeros(())
    for t in reversed(range(3)):
        running = deltas[t] + gamma * lam * running
        expected[t] = running
    torch.testing.assert_close(batch.advantages[2, :3], expected)
    # The kept transition's one-step term is its reward plus the discounted value of the
    # next stored step: the state the restore sent the env back to.
    one_step = batch.advantages[2, 1] - gamma * lam * batch.advantages[2, 2]
    torch.testing.assert_close(one_step, r[1] + gamma * v[2] - v[1])
    assert batch.valid[2].tolist() == [True, True, True, False, False]


def test_a_kept_transition_must_lie_between_the_dropped_position_and_the_cursor() -> None:
    buf = _buffer()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        _step(buf, g)
    with pytest.raises(ValueError, match=r"\[2, 3\)"):
        buf.invalidate(0, from_step=2, keep=1)
    with pytest.raises(ValueError, match=r"\[2, 3\)"):
        buf.invalidate(0, from_step=2, keep=3)
    assert buf.pos == [3, 3, 3]


def test_a_rollout_of_one_episode_an_env_is_unbroken_until_a_reset_or_a_restore() -> None:
    """``PPOBatch.breaks`` says where each env's chain of states breaks (the replay runs
    the stretches between in one LSTM call): nowhere while every env's state chains from
    its step 0; an episode start later, or a governor restore, breaks it there."""
    buf = _buffer()
    _fill(buf, seed=0)
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    assert batch.unbroken and batch.breaks == ((),) * E
    assert batch.select_envs(torch.tensor([2, 0])).breaks == ((), ())

    buf.reset()
    g = torch.Generator().manual_seed(1)
    _step(buf, g, start=True)
    _step(buf, g, start=True)  # a second episode starts at step 1
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    assert not batch.unbroken and batch.breaks == ((1,),) * E

    buf.reset()
    _fill(buf, seed=2)
    assert buf.finish(torch.zeros(E), 0.99, 0.95).unbroken
    buf.invalidate(1, 2, keep=3)  # env 1's kept step 3 moves to 2, flagged a restart
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    assert not batch.unbroken and batch.hidden_restarts.any()
    assert batch.breaks == ((), (2,), ())
    _step(buf, g, active=[False, True, False])  # it acts from the restored state: a break
    assert buf.finish(torch.zeros(E), 0.99, 0.95).breaks == ((), (2, 3), ())
    assert batch.select_envs(torch.tensor([1, 0])).breaks == ((2,), ())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, E - 1), st.integers(0, T)), max_size=12)
)
def test_a_batchs_breaks_are_where_its_flags_break_the_chain_of_states(
    moves: list[tuple[int, int, int]],
) -> None:
    """Whatever steps, episode starts and restores a rollout went through, the breaks the
    buffer kept host-side are the valid steps after step 0 flagged an episode start or a
    hidden restart on the device: where the step-by-step replay leaves the chain."""
    buf = _buffer()
    g = torch.Generator().manual_seed(0)
    _step(buf, g, start=True)
    for kind, env, at in moves:
        if kind < 2 and min(buf.pos) < T:
            _step(buf, g, start=kind == 1, active=[p < T for p in buf.pos])
        elif kind == 2 and buf.pos[env] > 1:
            from_step = min(at, buf.pos[env] - 1)
            keep = buf.pos[env] - 1 if at % 2 else None
            buf.invalidate(env, from_step, keep)
    if min(buf.pos) == 0:
        return
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    flagged = (batch.episode_starts | batch.hidden_restarts) & batch.valid
    want = tuple(tuple(int(t) for t in row[1:].nonzero().flatten() + 1) for row in flagged)
    assert batch.breaks == want


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_batch_split_into_parts_holds_the_rows_a_selection_would_as_views(parts: int) -> None:
    """The PPO update shuffles its batch once an epoch and cuts it into minibatches: the
    same rows as selecting each minibatch's envs, without copying them."""
    buf = _buffer()
    _fill(buf, seed=3)
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    pieces = batch.split_envs(parts)
    assert len(pieces) == parts
    for piece, env_idx in zip(pieces, torch.arange(E).tensor_split(parts), strict=True):
        want = batch.select_envs(env_idx)
        assert piece.breaks == want.breaks
        for got, expected in zip(_tensors(piece), _tensors(want), strict=True):
            assert torch.equal(got, expected)
        assert piece.obs.untyped_storage().data_ptr() == batch.obs.untyped_storage().data_ptr()


def _tensors(batch: PPOBatch) -> list[torch.Tensor]:
    """Every tensor of ``batch``, masks and LSTM states included, in field order."""
    out: list[torch.Tensor] = []
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, ActionMasks):
            out.extend(dataclasses.astuple(value))
        elif isinstance(value, tuple) and f.name != "breaks":
            out.extend(value)
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


def test_a_batch_moves_whole_to_another_device_and_stays_where_it_is() -> None:
    """What a learner copy on another device trains on (``PPOModule(learner_device=...)``):
    every tensor moved, shapes and dtypes kept (here to ``meta``, which any machine has)."""
    buf = _buffer()
    _fill(buf, seed=4)
    batch = buf.finish(torch.zeros(E), 0.99, 0.95)
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    assert moved.breaks == batch.breaks
    for got, there in zip(_tensors(moved), _tensors(batch), strict=True):
        assert got.device.type == "meta"
        assert (got.shape, got.dtype) == (there.shape, there.dtype)
