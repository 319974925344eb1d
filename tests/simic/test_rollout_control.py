"""The rollout's control surface: a governor restores one env and charges the panicking step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from esper.contracts.rollout import StepBatch
from esper.host_reads import HostReadCounter
from esper.simic.control import EnvSnapshot, GovernorRead, PanicConfig, RolloutControl
from esper.simic.rollout import RolloutCollector
from tests.simic.envs import collector, small_env

N_ENVS = 2
EPISODE_EPOCHS = 6
RESTORED = 0
#: The read at which the scripted governor restores env RESTORED; it closes decision
#: RESTORE_AT - 1, the transition that must carry the penalty.
RESTORE_AT = 3


@dataclass
class ScriptedGovernor:
    """Restores one env to its first snapshot at a chosen read, as if that read panicked."""

    restore_at: int = RESTORE_AT
    panic: PanicConfig = field(default_factory=PanicConfig)
    first: EnvSnapshot | None = None
    reads: list[GovernorRead] = field(default_factory=list)

    def steer(self, control: RolloutControl, read: GovernorRead) -> None:
        self.reads.append(read)
        if read.step == 0:
            self.first = control.snapshot(RESTORED)
        elif read.step == self.restore_at:
            assert self.first is not None
            control.request_restore(RESTORED, self.first, "scripted")
            control.penalise(RESTORED)


def _run(governor: ScriptedGovernor | None) -> tuple[RolloutCollector, list[StepBatch], list]:
    col = collector(small_env(N_ENVS, EPISODE_EPOCHS), seed=0)
    col.set_governor(governor)
    steps: list[StepBatch] = []
    stored: list[float] = []

    def on_step(step: StepBatch) -> None:
        steps.append(step)
        # The reward just written for the restored env's transition of this step.
        stored.append(col.buffer.rewards[RESTORED, step.step].item())

    col.collect(0, on_step=on_step)
    return col, steps, stored


@pytest.fixture(scope="module")
def runs() -> tuple[tuple, tuple]:
    return _run(None), _run(ScriptedGovernor())


def test_the_penalty_lands_on_the_transition_of_the_read_that_restored(
    runs: tuple[tuple, tuple],
) -> None:
    (plain, plain_steps, _), (col, steps, stored) = runs
    penalty = col.env.config.rewards.rollback_penalty
    charged = RESTORE_AT - 1
    rollback = np.array([s.reward_components["rollback"] for s in steps])
    expected = np.zeros_like(rollback)
    expected[charged, RESTORED] = -penalty
    np.testing.assert_array_equal(rollback, expected)
    # Up to and including that transition the runs are alike but for the penalty itself.
    for t in range(charged + 1):
        want = plain_steps[t].rewards.copy()
        want[RESTORED] -= penalty if t == charged else 0.0
        np.testing.assert_allclose(steps[t].rewards, want, rtol=1e-6)
    assert stored[charged] == pytest.approx(steps[charged].rewards[RESTORED])
    # The restore itself is reported with the step whose read triggered it.
    assert [e.env for e in steps[charged].events if e.kind == "rollback"] == [RESTORED]
    assert plain.buffer.valid.all()


def test_only_the_restored_env_loses_its_segment_and_sits_out_one_decision(
    runs: tuple[tuple, tuple],
) -> None:
    (_, _, _), (col, steps, _) = runs
    sat_out = [s.step for s in steps if not s.active[RESTORED]]
    assert sat_out == [RESTORE_AT]
    other = 1 - RESTORED
    assert bool(col.buffer.valid[other].all())
    # Restored to its step-0 snapshot: it rewrites its segment from position 0.
    n_valid = int(col.buffer.valid[RESTORED].sum())
    assert n_valid == EPISODE_EPOCHS - 1 - RESTORE_AT - 1
    assert bool(col.buffer.valid[RESTORED, :n_valid].all())


def test_the_governor_sees_every_read_but_the_last_with_host_side_panic_codes(
    runs: tuple[tuple, tuple],
) -> None:
    (_, _, _), (col, _, _) = runs
    governor = col.governor
    assert isinstance(governor, ScriptedGovernor)
    assert [r.step for r in governor.reads] == list(range(EPISODE_EPOCHS - 1))
    for read in governor.reads:
        assert isinstance(read.panic, np.ndarray) and read.panic.shape == (N_ENVS,)
        assert read.host_epoch == read.step + 1


def test_a_governed_rollout_with_a_restore_still_reads_the_device_once_per_epoch() -> None:
    col = collector(small_env(N_ENVS, EPISODE_EPOCHS), seed=0)
    col.set_governor(ScriptedGovernor())
    with HostReadCounter() as counter:
        _, summary = col.collect(0)
    assert counter.count == EPISODE_EPOCHS, counter.report()
    assert summary.rollbacks.tolist() == [1, 0]


def test_penalise_outside_steer_is_refused() -> None:
    col = collector(small_env(N_ENVS, 3), seed=0)
    with pytest.raises(RuntimeError, match="steer"):
        col.penalise(0)


def test_a_snapshot_of_another_rollout_cannot_be_restored() -> None:
    col = collector(small_env(N_ENVS, 3), seed=0)
    governor = ScriptedGovernor(restore_at=EPISODE_EPOCHS)  # never restores by itself
    col.set_governor(governor)
    col.collect(0)
    stale = governor.first
    assert stale is not None
    col.collect(1)
    with pytest.raises(ValueError, match="snapshot of this rollout"):
        col.request_restore(RESTORED, stale, "stale")
