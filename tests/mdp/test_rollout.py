"""The rollout loop: one packed read per host epoch, whatever the number of envs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from esper.contracts.rollout import StepBatch
from esper.host_reads import HostReadCounter
from tests.mdp.envs import collector, small_env
from tests.tolaria.stacking import count_stacked_steps

EPISODE_EPOCHS = 3


@pytest.mark.parametrize("n_envs", [2, 8])
def test_rollout_reads_the_device_once_per_host_epoch(n_envs: int) -> None:
    col = collector(small_env(n_envs, EPISODE_EPOCHS))
    with HostReadCounter() as counter:
        _, summary = col.collect_batch(0)
    # One read per host epoch: after each decision's epoch, plus the bootstrap read.
    assert counter.count == EPISODE_EPOCHS, counter.report()
    # The transfers the loop reports are the reads that were measured, not just its tally.
    assert summary.packed_transfers == counter.count


def test_every_transition_reaches_the_step_hook_with_host_side_arrays() -> None:
    col = collector(small_env(2, EPISODE_EPOCHS))
    steps: list[StepBatch] = []
    batch, summary = col.collect_batch(3, on_step=steps.append)
    assert [s.step for s in steps] == list(range(EPISODE_EPOCHS - 1))
    assert all(s.rollout == 3 for s in steps)
    assert [bool(s.done.all()) for s in steps] == [False] * (EPISODE_EPOCHS - 2) + [True]
    for s in steps:
        for value in (
            s.actions,
            s.rewards,
            s.val_acc,
            s.contribution,
            *s.reward_components.values(),
        ):
            assert isinstance(value, np.ndarray)
        np.testing.assert_allclose(s.rewards, sum(s.reward_components.values()), rtol=1e-6)
    np.testing.assert_allclose(
        summary.episode_return, np.sum([s.rewards for s in steps], axis=0), rtol=1e-5
    )
    # The buffer holds the same rewards and actions the hook saw.
    np.testing.assert_allclose(
        batch.advantages.new_tensor(np.stack([s.rewards for s in steps], 1)).numpy(),
        col.buffer.rewards.numpy(),
        rtol=1e-6,
    )
    assert torch.equal(
        col.buffer.actions, torch.from_numpy(np.stack([s.actions for s in steps], 1))
    )


def test_rollout_gives_a_ppo_batch_with_every_step_valid_and_the_last_terminated() -> None:
    col = collector(small_env(2, EPISODE_EPOCHS))
    batch, _ = col.collect_batch(0)
    assert batch.valid.all()
    assert col.buffer.terminated[:, -1].all() and not col.buffer.terminated[:, :-1].any()
    assert batch.episode_starts[:, 0].all() and not batch.episode_starts[:, 1:].any()
    assert torch.isfinite(batch.advantages).all()


def test_actions_taken_are_legal_under_the_masks() -> None:
    col = collector(small_env(4, 4))
    steps: list[StepBatch] = []
    col.collect_batch(0, on_step=steps.append)
    assert not any(s.illegal.any() for s in steps)


def test_the_normaliser_learns_from_each_rollout_once() -> None:
    col = collector(small_env(2, EPISODE_EPOCHS))
    col.collect_batch(0)
    count = float(col.normalizer.count)
    assert count == 2 * (EPISODE_EPOCHS - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_envs", [2, 8])
def test_cuda_rollout_reads_the_device_once_per_host_epoch(n_envs: int) -> None:
    from esper.mdp.env import MorphogeneticVecEnv
    from esper.mdp.env_config import EnvConfig
    from tests.mdp.envs import small_data

    config = EnvConfig(
        n_envs=n_envs, episode_epochs=EPISODE_EPOCHS, host_kwargs={"channels": [4, 8]}
    )
    env = MorphogeneticVecEnv(config, small_data(), "cuda")
    col = collector(env)
    col.collect_batch(0)  # warm-up: lazy CUDA init makes reads of its own
    with HostReadCounter() as counter:
        batch, summary = col.collect_batch(1)
    assert counter.count == EPISODE_EPOCHS, counter.report()
    assert summary.packed_transfers == counter.count
    assert batch.advantages.device.type == "cuda"


def test_the_policy_acts_and_bootstraps_at_its_own_thread_count() -> None:
    """``policy_threads`` holds for the controller's act and value, and only for them."""
    col = collector(small_env(2, EPISODE_EPOCHS))
    col.policy_threads = 1
    seen: list[tuple[str, int]] = []
    policy = col.policy
    act, value = col._act, policy.value

    def counting_act(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("act", torch.get_num_threads()))
        return act(*args, **kwargs)

    def counting_value(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(("value", torch.get_num_threads()))
        return value(*args, **kwargs)

    col._act = counting_act
    policy.value = counting_value  # type: ignore[method-assign]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        col.collect_batch(0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert seen == [("act", 1)] * (EPISODE_EPOCHS - 1) + [("value", 1)]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("engine", ["per_env", "stacked", "per_env_graphs", "stacked_graphs"])
def test_a_rollout_that_widens_and_merges_still_reads_the_device_once_per_host_epoch(
    device: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Widening seeds (their gradient-chosen start, blending through new channels and the
    merge at fossilize) add no read: every env trains in the main thread here, where the
    counter sees every read; the stacked engine (the scripted controller grows both envs
    alike, so they train as one group) adds none either, nor does recording its step as a
    CUDA graph (on a CPU, to a graph's rules: ``tests/tolaria/op_tape.py``)."""
    import dataclasses

    from esper.tolaria import step_graph
    from tests.tolaria.op_tape import TapeRecorder

    recorders: list[TapeRecorder] = []

    def tape(on: torch.device) -> TapeRecorder:
        recorders.append(TapeRecorder(on))
        return recorders[-1]

    if engine.endswith("_graphs") and device == "cpu":
        monkeypatch.setitem(step_graph.RECORDERS, "cpu", tape)
        monkeypatch.setattr(step_graph, "_made", {})

    from esper.kasmina import LifecycleConfig
    from esper.mdp.env import MorphogeneticVecEnv
    from esper.mdp.env_config import EnvConfig
    from esper.mdp.rollout import RolloutCollector
    from esper.mdp.transitions import Cursors
    from esper.tamiyo.heuristic import SCRIPTED_GROWTH, HeuristicController
    from tests.mdp.envs import small_data

    epochs = 7
    fast = LifecycleConfig(
        min_training_epochs=1, blend_epochs=1, min_holding_epochs=0, min_contribution=-1.0
    )
    config = EnvConfig(
        n_envs=2,
        episode_epochs=epochs,
        host_kwargs={"channels": [4, 8]},
        blueprints=("widen",),
        widen_init="gradient",
        lifecycle=fast,
        cpu_workers=1,
        engine=engine.removesuffix("_graphs"),
        cuda_graphs=engine.endswith("_graphs"),
    )
    env = MorphogeneticVecEnv(config, small_data(), device)
    config = dataclasses.replace(
        SCRIPTED_GROWTH, blueprint_preference=("widen",), max_germinate_fraction=0.5
    )
    controller = HeuristicController(env.layout, env.schema, config).to(env.device)
    # Raw observations, as evaluation hands the heuristic; nothing kept but the cursors.
    col = RolloutCollector(env, controller, Cursors(env.n_envs, env.decisions_per_episode))
    torch.manual_seed(0)
    stacked_steps = count_stacked_steps(monkeypatch)
    if device == "cuda":
        col.collect(0)  # warm-up: lazy CUDA init makes reads of its own
    with HostReadCounter() as counter:
        summary = col.collect(1).summary
    assert counter.count == summary.packed_transfers == epochs, counter.report()
    assert summary.seeds_fossilized.sum() > 0
    assert any(slot.merged for host in env.hosts for slot in host.model.iter_slots())
    assert bool(stacked_steps) == engine.startswith("stacked")
    # The summary's share is counted from the samples each env trained stacked.
    assert (summary.stacked_share > 0) == engine.startswith("stacked")
    if recorders:
        assert sum(r.replays for r in recorders) > 0
    assert 0 <= summary.stacked_share <= 1
    if device == "cuda":
        # Nothing but the step's read waits for the device: CUDA's sync debug mode warns
        # at every synchronising call (a blocking upload of a planted seed among them).
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                col.collect(2)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
        assert len(syncs) <= epochs, [str(w.message) for w in syncs[:5]]
