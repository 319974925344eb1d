"""The governor restores only the env that panicked, keeps every other env's data, and
charges the penalty to the transition whose epoch panicked, which stays in the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from esper.callbacks.governor import GovernorCallback
from esper.contracts.rollout import StepBatch
from esper.mdp.governor import PANIC_NONE, PANIC_SIGNAL
from esper.simic.ppo import PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_collector import PPOCollector
from tests.mdp.envs import collector, small_env

N_ENVS = 4
EPISODE_EPOCHS = 8
FAULTY_ENV = 1
#: The fault is planted when the transition of the step before closes, so the epoch after
#: this step's decision is the one whose loss is non-finite.
FAULT_STEP = 4
SNAPSHOT_EVERY = 3

BUFFER_FIELDS = (
    "obs",
    "raw_obs",
    "actions",
    "log_probs",
    "values",
    "rewards",
    "valid",
    "terminated",
    "hidden_h",
    "hidden_c",
    "hidden_restarts",
)
#: The routine snapshot before the fault (read SNAPSHOT_EVERY - 1), at this position.
SNAPSHOT_POS = SNAPSHOT_EVERY - 1


def _run(fault: bool) -> tuple[PPOCollector, GovernorCallback, list[StepBatch]]:
    col = collector(small_env(N_ENVS, EPISODE_EPOCHS), seed=0)
    governor = GovernorCallback(snapshot_every=SNAPSHOT_EVERY)
    col.set_governor(governor)
    steps: list[StepBatch] = []

    def on_step(step: StepBatch) -> None:
        steps.append(step)
        if fault and step.step == FAULT_STEP - 1:
            with torch.no_grad():
                col.env.hosts[FAULTY_ENV].model.head.weight.fill_(float("nan"))

    batch, summary = col.collect_batch(0, on_step=on_step)
    governor.on_rollout_end(None, None, summary)  # type: ignore[arg-type]
    col.last_batch = batch  # type: ignore[attr-defined]
    col.last_summary = summary  # type: ignore[attr-defined]
    return col, governor, steps


@pytest.fixture(scope="module")
def runs() -> tuple[tuple, tuple]:
    return _run(fault=False), _run(fault=True)


def test_only_the_faulty_env_is_rolled_back(runs: tuple[tuple, tuple]) -> None:
    (_, clean_gov, _), (faulty, gov, steps) = runs
    assert clean_gov.total_rollbacks == 0
    assert faulty.last_summary.rollbacks.tolist() == [0, 1, 0, 0]
    panics = [s for s in steps if s.probes[PANIC_SIGNAL][FAULTY_ENV] > PANIC_NONE]
    assert panics and all(s.probes[PANIC_SIGNAL][[0, 2, 3]].sum() == 0 for s in steps)
    rollbacks = [e for s in steps for e in s.events if e.kind == "rollback"]
    assert [e.env for e in rollbacks] == [FAULTY_ENV]
    assert "non-finite" in rollbacks[0].reason
    assert gov.total_rollbacks == 1


def test_other_envs_buffers_are_bit_identical_to_a_run_without_the_fault(
    runs: tuple[tuple, tuple],
) -> None:
    (clean, _, _), (faulty, _, _) = runs
    for name in BUFFER_FIELDS:
        a, b = getattr(clean.buffer, name), getattr(faulty.buffer, name)
        for env in range(N_ENVS):
            if env != FAULTY_ENV:
                assert torch.equal(a[env], b[env]), f"{name} differs for env {env}"
    for name in ("op", "slot", "blueprint", "blend"):
        a, b = getattr(clean.buffer.masks, name), getattr(faulty.buffer.masks, name)
        assert torch.equal(a[[0, 2, 3]], b[[0, 2, 3]])


def test_only_the_faulty_envs_transitions_after_its_snapshot_are_dropped(
    runs: tuple[tuple, tuple],
) -> None:
    (clean, _, _), (faulty, _, _) = runs
    dropped = int(faulty.last_summary.discarded_transitions[FAULTY_ENV])
    assert dropped == FAULT_STEP - SNAPSHOT_POS  # all since the snapshot but the panicking one
    before = slice(0, SNAPSHOT_POS)
    for name in ("obs", "actions", "rewards", "log_probs"):
        assert torch.equal(
            getattr(clean.buffer, name)[FAULTY_ENV, before],
            getattr(faulty.buffer, name)[FAULTY_ENV, before],
        )
    # The panicking transition, as the env acted it (the same as the clean run's until
    # the fault's epoch), now lies at the snapshot's position.
    for name in ("obs", "actions", "log_probs", "values", "hidden_h", "hidden_c"):
        assert torch.equal(
            getattr(clean.buffer, name)[FAULTY_ENV, FAULT_STEP],
            getattr(faulty.buffer, name)[FAULTY_ENV, SNAPSHOT_POS],
        ), name
    # The env kept stepping after its restore, on the restored host: its loss is finite.
    valid = faulty.buffer.valid[FAULTY_ENV]
    n_valid = int(valid.sum())
    assert n_valid == EPISODE_EPOCHS - 1 - dropped - 1  # minus the step it sat out
    assert valid[:n_valid].all() and not valid[n_valid:].any()
    assert torch.isfinite(faulty.buffer.obs[FAULTY_ENV, :n_valid]).all()
    assert torch.isfinite(faulty.buffer.rewards[FAULTY_ENV, :n_valid]).all()
    assert faulty.buffer.terminated[FAULTY_ENV, n_valid - 1]
    # The kept transition and the one after it replay from their stored LSTM states.
    restarts = faulty.buffer.hidden_restarts[FAULTY_ENV].nonzero().flatten().tolist()
    assert restarts == [SNAPSHOT_POS, SNAPSHOT_POS + 1]


def test_the_rollback_penalty_is_charged_to_the_restored_env(runs: tuple[tuple, tuple]) -> None:
    (_, _, _), (_, _, steps) = runs
    charged = [s.reward_components["rollback"] for s in steps]
    total = np.sum(charged, axis=0)
    assert total[FAULTY_ENV] < 0
    assert (total[[0, 2, 3]] == 0).all()


def test_the_penalty_is_charged_to_the_transition_whose_epoch_panicked(
    runs: tuple[tuple, tuple],
) -> None:
    (_, _, _), (faulty, _, steps) = runs
    penalty = faulty.env.config.rewards.rollback_penalty
    panicked = [s.step for s in steps if s.probes[PANIC_SIGNAL][FAULTY_ENV] > PANIC_NONE]
    assert panicked == [FAULT_STEP]
    charged = {s.step: s.reward_components["rollback"][FAULTY_ENV] for s in steps}
    assert charged[FAULT_STEP] == -penalty
    assert all(c == 0 for step, c in charged.items() if step != FAULT_STEP)
    # That transition stays in the PPO batch, moved to the snapshot's position, and its
    # stored reward carries the penalty.
    batch = faulty.last_batch
    assert batch.valid[FAULTY_ENV, SNAPSHOT_POS]
    stored = faulty.buffer.rewards[FAULTY_ENV, SNAPSHOT_POS]
    assert stored.item() == pytest.approx(steps[FAULT_STEP].rewards[FAULTY_ENV])
    assert steps[FAULT_STEP].rewards[FAULTY_ENV] == pytest.approx(
        sum(c[FAULTY_ENV] for c in steps[FAULT_STEP].reward_components.values())
    )


def test_the_update_replays_a_rolled_back_rollout_as_it_was_acted(
    runs: tuple[tuple, tuple],
) -> None:
    (_, _, _), (faulty, _, _) = runs
    batch = faulty.last_batch
    with torch.no_grad():
        log_prob, _, value = faulty.policy.evaluate(
            batch.obs,
            batch.hidden0,
            batch.masks,
            batch.actions,
            batch.episode_starts,
            hidden_restarts=batch.hidden_restarts,
            stored_hidden=batch.hidden,
        )
    valid = batch.valid
    torch.testing.assert_close(log_prob[valid], batch.log_probs[valid])
    torch.testing.assert_close(value[valid], batch.values[valid])
    assert torch.isfinite(batch.advantages[valid]).all()


def test_training_goes_on_after_a_rollback() -> None:
    # Its own run: updating the policy and collecting again would change the shared one.
    faulty, _, _ = _run(fault=True)
    config = PPOConfig(n_minibatches=2, update_epochs=1)
    policy = faulty.policy
    stats = ppo_update(policy, make_optimizer(policy, config), faulty.last_batch, config)
    assert all(torch.isfinite(v) for v in stats.values())
    _, summary = faulty.collect_batch(1)
    assert np.isfinite(summary.episode_return).all()


def test_bad_snapshot_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_every"):
        GovernorCallback(snapshot_every=0)
