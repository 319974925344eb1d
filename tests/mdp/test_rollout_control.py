"""The rollout's control surface: a governor restores one env, and the transition whose
epoch panicked reaches PPO with its penalty, replayed from the states the policy acted from."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from esper.contracts.config_errors import ConfigError
from esper.contracts.rollout import StepBatch
from esper.host_reads import HostReadCounter
from esper.mdp.governor import EnvSnapshot, GovernorRead, PanicConfig, RolloutControl
from esper.simic.ppo import PPOBatch
from esper.simic.ppo_collector import PPOCollector
from tests.mdp.envs import GAMMA, LAMBDA, collector, small_env
from tests.ops import LaunchCounter
from tests.tolaria.stacking import count_stacked_steps

N_ENVS = 2
#: Six decisions per episode: steps 0 to 5.
EPISODE_EPOCHS = 7
RESTORED = 0
OTHER = 1 - RESTORED
#: The read at which the scripted governor snapshots env RESTORED: its transition of
#: that step lies at this position, and its LSTM state there is not the initial one.
SNAPSHOT_AT = 1
#: The read at which it restores that env; it closes decision RESTORE_AT - 1, the
#: transition that must carry the penalty and stay in the batch.
RESTORE_AT = 4
#: Two restores to the same snapshot: the second must not drop what the first kept.
TWICE = (3, 5)

#: Per-step buffer fields compared between act time and the finished batch.
FIELDS = ("obs", "raw_obs", "actions", "log_probs", "values", "hidden_h", "hidden_c")
MASKS = ("op", "slot", "blueprint", "blend")


@dataclass
class ScriptedGovernor:
    """Snapshots one env at a chosen read and restores it there at chosen reads, charging
    the penalty, as if those reads panicked."""

    restore_at: tuple[int, ...] = (RESTORE_AT,)
    snapshot_at: int = SNAPSHOT_AT
    panic: PanicConfig = field(default_factory=PanicConfig)
    snap: EnvSnapshot | None = None
    reads: list[GovernorRead] = field(default_factory=list)

    def steer(self, control: RolloutControl, read: GovernorRead) -> None:
        self.reads.append(read)
        if read.step == self.snapshot_at:
            self.snap = control.snapshot(RESTORED)
        elif read.step in self.restore_at:
            assert self.snap is not None
            control.request_restore(RESTORED, self.snap, "scripted")
            control.penalise(RESTORED)


@dataclass
class Run:
    """One collected rollout and what the restored env recorded when it acted."""

    col: PPOCollector
    batch: PPOBatch
    steps: list[StepBatch]
    #: Per step closed, the restored env's transition as stored right after it was priced
    #: (before any restore moved it), keyed by field.
    acted: list[dict[str, torch.Tensor]]


def _run(governor: ScriptedGovernor | None) -> Run:
    col = collector(small_env(N_ENVS, EPISODE_EPOCHS), seed=0)
    col.set_governor(governor)
    steps: list[StepBatch] = []
    acted: list[dict[str, torch.Tensor]] = []

    def on_step(step: StepBatch) -> None:
        steps.append(step)
        buf = col.buffer
        if not step.active[RESTORED]:
            acted.append({})  # it sat this decision out: nothing was written
            return
        # Its transition of this step is the last it wrote.
        pos = buf.pos[RESTORED] - 1
        record = {name: getattr(buf, name)[RESTORED, pos].clone() for name in FIELDS}
        record |= {m: getattr(buf.masks, m)[RESTORED, pos].clone() for m in MASKS}
        record["rewards"] = buf.rewards[RESTORED, pos].clone()
        acted.append(record)

    batch, _ = col.collect_batch(0, on_step=on_step)
    return Run(col, batch, steps, acted)


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    return {
        "plain": _run(None),
        "once": _run(ScriptedGovernor()),
        "twice": _run(ScriptedGovernor(restore_at=TWICE)),
    }


def _assert_transition(batch: PPOBatch, pos: int, acted: dict[str, torch.Tensor]) -> None:
    """The restored env's transition at ``pos`` of ``batch`` is ``acted``, field by field."""
    stored = {
        "obs": batch.obs,
        "actions": batch.actions,
        "log_probs": batch.log_probs,
        "values": batch.values,
        "hidden_h": batch.hidden[0],
        "hidden_c": batch.hidden[1],
    }
    for name, tensor in stored.items():
        assert torch.equal(tensor[RESTORED, pos], acted[name]), name
    for m in MASKS:
        assert torch.equal(getattr(batch.masks, m)[RESTORED, pos], acted[m]), m


def test_the_panicking_transition_stays_in_the_batch_with_its_penalty(
    runs: dict[str, Run],
) -> None:
    plain, run = runs["plain"], runs["once"]
    batch, penalty = run.batch, run.col.env.config.rewards.rollback_penalty
    charged = RESTORE_AT - 1
    # Kept at the snapshot's position, the first it drops; the steps between are gone.
    kept, after = SNAPSHOT_AT, SNAPSHOT_AT + 1
    assert batch.valid[RESTORED].tolist() == [True] * (after + 1) + [False] * 3
    assert bool(batch.valid[OTHER].all())
    _assert_transition(batch, kept, run.acted[charged])
    stored_reward = run.col.buffer.rewards[RESTORED, kept].item()
    assert stored_reward == pytest.approx(run.steps[charged].rewards[RESTORED])
    assert stored_reward == pytest.approx(plain.steps[charged].rewards[RESTORED] - penalty)
    assert run.steps[charged].reward_components["rollback"][RESTORED] == -penalty
    # The env sat out the decision of the restoring read; its next one follows the kept
    # transition directly, acting from the snapshot's LSTM state.
    assert [s.step for s in run.steps if not s.active[RESTORED]] == [RESTORE_AT]
    _assert_transition(batch, after, run.acted[RESTORE_AT + 1])
    for name, state in zip(("hidden_h", "hidden_c"), batch.hidden, strict=True):
        assert torch.equal(state[RESTORED, after], run.acted[SNAPSHOT_AT][name])
    # Those two steps replay from their stored states; no other step does.
    restarts = torch.zeros_like(batch.hidden_restarts)
    restarts[RESTORED, [kept, after]] = True
    assert torch.equal(batch.hidden_restarts, restarts)
    # Before the snapshot the env's data is what it recorded when acting.
    _assert_transition(batch, 0, run.acted[0])
    assert run.col.buffer.rewards[RESTORED, 0].item() == pytest.approx(
        plain.steps[0].rewards[RESTORED]
    )


def test_the_restore_is_reported_with_the_step_whose_read_triggered_it(
    runs: dict[str, Run],
) -> None:
    run = runs["once"]
    charged = RESTORE_AT - 1
    rollback = np.array([s.reward_components["rollback"] for s in run.steps])
    expected = np.zeros_like(rollback)
    expected[charged, RESTORED] = -run.col.env.config.rewards.rollback_penalty
    np.testing.assert_array_equal(rollback, expected)
    assert [e.env for e in run.steps[charged].events if e.kind == "rollback"] == [RESTORED]
    assert runs["plain"].col.buffer.valid.all()


def test_a_second_restore_to_the_same_snapshot_keeps_what_the_first_kept(
    runs: dict[str, Run],
) -> None:
    run = runs["twice"]
    batch, penalty = run.batch, run.col.env.config.rewards.rollback_penalty
    first, second = (t - 1 for t in TWICE)  # the steps whose epochs panicked
    # Step 0, then the first kept transition at the snapshot's position, then the second
    # (it was the first step after the first restore, so nothing lay between them).
    assert batch.valid[RESTORED].tolist() == [True] * 3 + [False] * 3
    for pos, step in ((0, 0), (SNAPSHOT_AT, first), (SNAPSHOT_AT + 1, second)):
        _assert_transition(batch, pos, run.acted[step])
    rewards = run.col.buffer.rewards[RESTORED]
    for pos, step in ((SNAPSHOT_AT, first), (SNAPSHOT_AT + 1, second)):
        assert rewards[pos].item() == pytest.approx(run.steps[step].rewards[RESTORED])
        assert run.steps[step].reward_components["rollback"][RESTORED] == -penalty
    assert batch.hidden_restarts[RESTORED].tolist() == [False, True, True] + [False] * 3


@pytest.mark.parametrize("name", ["plain", "once", "twice"])
def test_replaying_the_batch_reproduces_what_the_policy_computed_when_acting(
    runs: dict[str, Run], name: str
) -> None:
    run = runs[name]
    batch, policy = run.batch, run.col.policy
    valid = batch.valid

    def replay(b: PPOBatch, restarts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            log_prob, _, value = policy.evaluate(
                b.obs,
                b.hidden0,
                b.masks,
                b.actions,
                b.episode_starts,
                hidden_restarts=restarts,
                stored_hidden=b.hidden,
            )
        return log_prob, value

    log_prob, value = replay(batch, batch.hidden_restarts)
    torch.testing.assert_close(log_prob[valid], batch.log_probs[valid])
    torch.testing.assert_close(value[valid], batch.values[valid])
    # A minibatch of the restored env alone carries its flags and states along.
    sub = batch.select_envs(torch.tensor([RESTORED]))
    sub_log_prob, sub_value = replay(sub, sub.hidden_restarts)
    torch.testing.assert_close(sub_log_prob[sub.valid], sub.log_probs[sub.valid])
    torch.testing.assert_close(sub_value[sub.valid], sub.values[sub.valid])
    if name != "plain":
        # The flags matter: chaining through the restore replays other states.
        _, chained = replay(batch, torch.zeros_like(batch.hidden_restarts))
        flagged = batch.hidden_restarts & valid
        assert not torch.allclose(chained[flagged], batch.values[flagged])


def test_the_kept_transition_bootstraps_from_the_restored_states_value(
    runs: dict[str, Run],
) -> None:
    run = runs["once"]
    batch, buf = run.batch, run.col.buffer
    kept = SNAPSHOT_AT
    adv, r, v = batch.advantages[RESTORED], buf.rewards[RESTORED], batch.values[RESTORED]
    # GAE: A[k] = r[k] + gamma V[k+1] - V[k] + gamma lambda A[k+1], where k+1 is the
    # step taken from the restored state.
    one_step = adv[kept] - GAMMA * LAMBDA * adv[kept + 1]
    torch.testing.assert_close(one_step, r[kept] + GAMMA * v[kept + 1] - v[kept])
    assert not buf.truncated[RESTORED, kept] and not buf.terminated[RESTORED, kept]


def test_the_governor_sees_every_read_but_the_last_with_host_side_panic_codes(
    runs: dict[str, Run],
) -> None:
    governor = runs["once"].col.governor
    assert isinstance(governor, ScriptedGovernor)
    assert [r.step for r in governor.reads] == list(range(EPISODE_EPOCHS - 1))
    for read in governor.reads:
        assert isinstance(read.panic, np.ndarray) and read.panic.shape == (N_ENVS,)
        assert read.host_epoch == read.step + 1


@pytest.mark.parametrize("engine", ["per_env", "stacked"])
def test_a_governed_rollout_with_a_restore_still_reads_the_device_once_per_epoch(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacked_steps = count_stacked_steps(monkeypatch)
    col = collector(small_env(N_ENVS, EPISODE_EPOCHS, engine=engine), seed=0)
    col.set_governor(ScriptedGovernor())
    with HostReadCounter() as counter:
        _, summary = col.collect_batch(0)
    assert counter.count == EPISODE_EPOCHS, counter.report()
    assert bool(stacked_steps) == (engine == "stacked")
    assert summary.rollbacks.tolist() == [1, 0]
    # Positions SNAPSHOT_AT .. RESTORE_AT - 2 were dropped; the panicking one was kept.
    assert summary.discarded_transitions.tolist() == [RESTORE_AT - 1 - SNAPSHOT_AT, 0]


def test_penalise_and_snapshot_outside_steer_are_refused() -> None:
    col = collector(small_env(N_ENVS, 3), seed=0)
    with pytest.raises(RuntimeError, match="steer"):
        col.steering.penalise(0)
    with pytest.raises(RuntimeError, match="steer"):
        col.steering.snapshot(0)


def test_an_env_being_restored_cannot_be_snapshotted_at_the_same_read() -> None:
    @dataclass
    class Greedy(ScriptedGovernor):
        def steer(self, control: RolloutControl, read: GovernorRead) -> None:
            super().steer(control, read)
            if read.step == RESTORE_AT:
                control.snapshot(RESTORED)

    col = collector(small_env(N_ENVS, EPISODE_EPOCHS), seed=0)
    col.set_governor(Greedy())
    with pytest.raises(ValueError, match="being restored"):
        col.collect_batch(0)


def test_a_snapshot_of_another_rollout_cannot_be_restored() -> None:
    col = collector(small_env(N_ENVS, 3), seed=0)
    governor = ScriptedGovernor(restore_at=())  # never restores by itself
    col.set_governor(governor)
    col.collect_batch(0)
    stale = governor.snap
    assert stale is not None
    col.collect_batch(1)
    with pytest.raises(ValueError, match="snapshot of this rollout"):
        col.steering.request_restore(RESTORED, stale, "stale")


@pytest.mark.parametrize(
    "change",
    [
        {"sigma": 0.0},
        {"sigma": float("nan")},
        {"window": 1},
        {"min_history": 1},
        {"min_history": 9},
        {"min_std": -1.0},
    ],
)
def test_panic_config_rejects_bad_values_naming_the_field(change: dict[str, object]) -> None:
    (field,) = change
    with pytest.raises(ConfigError, match=rf"^PanicConfig\.{field}: ") as info:
        PanicConfig(**change)  # type: ignore[arg-type]
    assert info.value.key == field


@dataclass
class SnapshotsAll(ScriptedGovernor):
    """Snapshots every env at every read, and keeps them."""

    taken: list[EnvSnapshot] = field(default_factory=list)

    def steer(self, control: RolloutControl, read: GovernorRead) -> None:
        self.taken += [control.snapshot(env) for env in range(read.n_envs)]


def _snapshot_read_ops(n_envs: int, monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """The operators that launch a kernel (``benchmarks/launch_rule.py``) at the first read,
    at which ``SnapshotsAll`` snapshots ``n_envs`` envs."""
    col = collector(small_env(n_envs, 3), seed=0)
    col.set_governor(SnapshotsAll())
    real = type(col.steering).steer
    counted: list[collections.Counter] = []

    def steer(self: object, *args: object, **kwargs: object) -> None:
        with LaunchCounter() as counter:
            real(self, *args, **kwargs)  # type: ignore[arg-type]
        counted.append(counter.ops)

    monkeypatch.setattr(type(col.steering), "steer", steer)
    col.collect_batch(0)
    return counted[0]


def test_a_reads_snapshots_are_copied_in_as_many_ops_whatever_the_number_of_envs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each snapshot's tensors join one set of multi-tensor copies, run as steer returns:
    no clone, no copy per env."""
    two, four = (_snapshot_read_ops(n, monkeypatch) for n in (2, 4))
    assert two == four, (two, four)
    assert set(two) == {"_foreach_copy_"}, two


def test_a_snapshot_holds_the_hosts_and_lstm_state_of_its_read() -> None:
    col = collector(small_env(N_ENVS, 3), seed=0)
    governor = SnapshotsAll()
    col.set_governor(governor)
    seen: list[tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = []
    real = col.steering.steer

    def steer(step: int, panic: object, fossilized: object, acted_from: tuple) -> None:
        real(step, panic, fossilized, acted_from=acted_from)  # type: ignore[arg-type]
        for env in range(N_ENVS):  # as they are once the read's copies ran
            host = col.env.hosts[env].model.state_dict()
            seen.append(
                (
                    {k: v.clone() for k, v in host.items()},
                    (acted_from[0][:, env].clone(), acted_from[1][:, env].clone()),
                )
            )

    col.steering.steer = steer  # type: ignore[method-assign]
    col.collect_batch(0)
    assert len(governor.taken) == len(seen) > 0
    for snapshot, (host, hidden) in zip(governor.taken, seen, strict=True):
        copied = snapshot.host.model.state_dict()
        assert copied.keys() == host.keys()
        assert all(torch.equal(copied[k], host[k]) for k in host)
        assert all(torch.equal(a, b) for a, b in zip(snapshot.hidden, hidden, strict=True))
