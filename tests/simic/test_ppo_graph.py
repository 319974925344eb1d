"""The PPO update's minibatch passes recorded and replayed (``esper.simic.ppo_graph``).

On a CPU the recorder is ``tests/tolaria/op_tape.TapeRecorder``: it holds a step to a CUDA
graph's rules (device work only, on fixed memory, no host reads) and runs the same
kernels in the same order, so a recorded update must equal an unrecorded one bit for bit.
The CUDA test at the end runs the real recorder where a GPU is at hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.host_reads import HostReadCounter
from esper.mdp.recorded_act import RecordedAct
from esper.simic import ppo_graph
from esper.simic.module import PPOModule
from esper.simic.ppo import PPOBatch, PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_graph import RecordedMinibatches
from esper.tamiyo.policy import PolicyNetwork
from esper.tolaria import step_graph
from tests.mdp.envs import small_data
from tests.simic.recorded_fit import recorded_fit
from tests.simic.test_ppo import _rollout_batch
from tests.tamiyo.factories import make_policy
from tests.tolaria.op_tape import TapeRecorder
from tests.trainers import quiet_trainer

#: Three updates whose entropy weight anneals, as ``ent_coef_final`` makes it.
ENT_COEFS = (0.01, 0.004, 0.0)
CONFIG = PPOConfig(update_epochs=2, n_minibatches=2)


def _batches() -> dict[str, PPOBatch]:
    policy = make_policy()
    broken = _rollout_batch(policy, n_steps=6, breaks_known=True)
    return {
        "unbroken": _rollout_batch(policy, n_steps=6, unbroken=True),
        "broken": broken,  # governor restores: each env its own breaks
        "stepped": dataclasses.replace(broken, breaks=None),  # the step-by-step replay
    }


class Updated(NamedTuple):
    policy: PolicyNetwork
    optimizer: torch.optim.Optimizer
    stats: list[dict[str, torch.Tensor]]
    recorded: RecordedMinibatches | None


def _updates(
    batch: PPOBatch,
    recorder: TapeRecorder | None,
    backward: Callable[[torch.Tensor], None] | None = None,
    config: PPOConfig = CONFIG,
    ent_coefs: tuple[float, ...] = ENT_COEFS,
    seed: int = 3,
) -> Updated:
    """Updates of a fresh policy on ``batch``, one an entropy weight, recorded by
    ``recorder`` or not."""
    policy = make_policy(seed=1)
    optimizer = make_optimizer(policy, config)
    recorded = None if recorder is None else RecordedMinibatches(policy, config, recorder)
    generator = torch.Generator().manual_seed(seed)
    stats = [
        ppo_update(
            policy,
            optimizer,
            batch,
            config,
            ent_coef=ent_coef,
            generator=generator,
            backward=backward,
            minibatch_passes=recorded,
        )
        for ent_coef in ent_coefs
    ]
    return Updated(policy, optimizer, stats, recorded)


def _assert_same_updates(a: Updated, b: Updated) -> None:
    """Weights, Adam's state and every statistic of every update, bit for bit."""
    for name, value in a.policy.state_dict().items():
        assert torch.equal(value, b.policy.state_dict()[name]), name
    for p_a, p_b in zip(a.policy.parameters(), b.policy.parameters(), strict=True):
        for key, value in a.optimizer.state[p_a].items():
            assert torch.equal(value, b.optimizer.state[p_b][key]), key
    for update_a, update_b in zip(a.stats, b.stats, strict=True):
        for name, value in update_a.items():
            assert torch.equal(value, update_b[name]), name


@pytest.mark.parametrize("kind", ["unbroken", "broken", "stepped"])
def test_recorded_updates_equal_unrecorded_ones(kind: str) -> None:
    """Weights, Adam's moments and every statistic, bit for bit, over three updates whose
    entropy weight changes: unbroken episodes (one fused LSTM call), restores with their
    breaks listed (segments) and without (the step loop)."""
    batch = _batches()[kind]
    recorder = TapeRecorder()
    _assert_same_updates(_updates(batch, None), _updates(batch, recorder))
    if kind != "broken":  # one layout a place: all replay but each place's first and a warm-up
        calls = len(ENT_COEFS) * CONFIG.update_epochs * CONFIG.n_minibatches
        assert recorder.recorded and recorder.replays == calls - CONFIG.n_minibatches - 1


@settings(max_examples=12, deadline=None)
@given(
    n_envs=st.integers(2, 6),
    n_steps=st.integers(2, 6),
    kind=st.sampled_from(["unbroken", "broken", "stepped"]),
    minibatches=st.integers(1, 3),
    normalize=st.booleans(),
    value_clip=st.sampled_from([None, 0.2]),
    critic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_recorded_updates_equal_unrecorded_ones_for_drawn_batches_and_configs(
    n_envs: int,
    n_steps: int,
    kind: str,
    minibatches: int,
    normalize: bool,
    value_clip: float | None,
    critic: bool,
    seed: int,
) -> None:
    """Any batch shape, minibatches of unequal sizes (two layouts), advantages
    normalised or not, value clipping on or off, a trained critic or none: bit for bit."""
    config = PPOConfig(
        update_epochs=2,
        n_minibatches=min(minibatches, n_envs),
        normalize_advantages=normalize,
        value_clip_coef=value_clip,
        critic_baseline=critic,
        vf_coef=0.5 if critic else 0.0,
        pair_size=None,  # one paired group of any size
    )
    batch = _rollout_batch(
        make_policy(),
        n_envs,
        n_steps,
        seed,
        unbroken=kind == "unbroken",
        breaks_known=kind == "broken",
    )
    _assert_same_updates(
        *(
            _updates(batch, r, config=config, ent_coefs=ENT_COEFS[:2], seed=seed)
            for r in (None, TapeRecorder())
        )
    )


@pytest.mark.parametrize("warmed", [False, True])
def test_one_recording_serves_every_update_of_a_run(warmed: bool) -> None:
    """Of the minibatches at each place of the epochs' shuffles (one layout a place),
    the first runs as it is, the next is recorded (the first place's after a warm-up on
    the recorder's stream, also where host steps warmed it up already), and every later
    one, in every update, replays it."""
    recorder = TapeRecorder()
    recorder.warmed = warmed
    recorded = _updates(_batches()["unbroken"], recorder).recorded
    assert recorded is not None
    first, second = recorded.steps
    assert (first.unrecorded, first.recordings, first.replays) == (2, 1, 4)
    assert (second.unrecorded, second.recordings, second.replays) == (1, 1, 5)
    assert len(recorder.recorded) == 2


def test_a_scaled_backward_scales_the_recorded_gradients() -> None:
    """The recorded gradients reach the parameters through the caller's backward (a
    Lightning ``manual_backward`` with a loss scaler's factor, say) as eager ones do."""

    def scaled(loss: torch.Tensor) -> None:
        (loss * 1024.0).backward()

    batch = _batches()["unbroken"]
    _assert_same_updates(_updates(batch, None, scaled), _updates(batch, TapeRecorder(), scaled))


def test_the_recorded_update_reads_nothing_on_the_host() -> None:
    """As the eager update: no read without ``target_kl`` (the recording itself would
    refuse one)."""
    batch = _batches()["unbroken"]
    with HostReadCounter() as counter:
        _updates(batch, TapeRecorder())
    assert counter.count == 0, counter.report()


def test_layouts_beyond_the_limit_let_the_least_recently_used_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Restores give minibatches breaks of their own: each such layout is one more
    entry, and no more than ``MAX_LAYOUTS`` are kept; results stay the eager ones."""
    monkeypatch.setattr(ppo_graph, "MAX_LAYOUTS", 2)
    batch = _batches()["broken"]
    updated = _updates(batch, TapeRecorder())
    assert updated.recorded is not None and len(updated.recorded.steps) == 2
    _assert_same_updates(_updates(batch, None), updated)


def _losses_read_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the recorded pass read its policy loss on the host, as a plugin's loss might:
    no graph can hold it."""
    losses = ppo_graph.minibatch_losses

    def reads(*args: object) -> object:
        out = losses(*args)  # type: ignore[arg-type]
        float(out.policy)
        return out

    monkeypatch.setattr(ppo_graph, "minibatch_losses", reads)


def test_a_step_that_cannot_be_recorded_warns_and_the_update_runs_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host read in the pass (a plugin's, say) fails the recording: a warning naming
    the error, then every minibatch runs as it is, with the eager results."""
    _losses_read_on_the_host(monkeypatch)
    batch = _batches()["unbroken"]
    recorder = TapeRecorder()
    with pytest.warns(RuntimeWarning, match="PPO minibatch step could not be recorded"):
        recorded = _updates(batch, recorder)
    assert recorder.refused is not None and recorder.replays == 0
    _assert_same_updates(_updates(batch, None), recorded)


@pytest.mark.slow
def test_a_fit_that_records_resumes_as_an_unbroken_fit_without_graphs(
    tmp_path: Path, taped: list[TapeRecorder]
) -> None:
    """``PPOModule(cuda_graphs=True)``: its updates replay their minibatches (Lightning
    still counts each optimizer step: ``max_steps`` stops the first fit after one
    update), and stopped and resumed it ends with the policy of an unbroken fit without
    graphs, update for update."""
    plain, plain_returns = recorded_fit(tmp_path / "plain", 3, engine="per_env")
    first, first_returns = recorded_fit(
        tmp_path / "graphs", 3, stop_after=1, engine="per_env", cuda_graphs=True
    )
    assert first._recorded is not None and first._recorded.steps[0].replays > 0
    resumed, resumed_returns = recorded_fit(
        tmp_path / "graphs", 3, ckpt_path="last", engine="per_env", cuda_graphs=True
    )
    assert first_returns + resumed_returns == plain_returns
    for name, value in plain.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_a_fit_whose_update_cannot_be_recorded_keeps_recording_its_host_steps(
    tmp_path: Path, taped: list[TapeRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update records on a recorder of its own: a pass that reads the host (a
    plugin's loss, say) warns and runs as it is, and the next update's host epochs still
    replay their recorded steps."""
    _losses_read_on_the_host(monkeypatch)
    replays: list[int] = []
    real_update = ppo_graph.RecordedMinibatches.__call__

    def noted(self: RecordedMinibatches, *args: object) -> object:
        replays.append(step_graph.recorder_for(torch.device("cpu")).replays)  # type: ignore[union-attr]
        return real_update(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ppo_graph.RecordedMinibatches, "__call__", noted)
    with pytest.warns(RuntimeWarning, match="PPO minibatch step could not be recorded"):
        module, _ = recorded_fit(tmp_path, 2, engine="stacked", cuda_graphs=True)
    host_steps = step_graph.recorder_for(torch.device("cpu"))
    assert host_steps is not None and host_steps.refused is None
    assert replays[-1] > replays[0] > 0  # the second update's epochs replayed
    assert module._recorded is not None
    assert all(step.recordings == 0 for step in module._recorded.steps)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_fit_records_its_update_only_outside_autocast(
    tmp_path: Path, taped: list[TapeRecorder], precision: str
) -> None:
    """Lightning runs a mixed-precision module's training step under autocast, whose cache
    of cast weights a recording cannot hold: there the update runs as it is. The rollout
    runs outside that autocast, so its acts go toward their recording either way (a
    fit's first two acts run as they are: the recording comes third)."""
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]}, cuda_graphs=True
    )
    trainer = quiet_trainer(tmp_path, 1, accelerator="cpu", precision=precision)
    trainer.fit(module, datamodule=small_data())
    act = module.collector._act
    assert isinstance(act, RecordedAct) and act.steps[False].unrecorded == 2
    if precision == "32-true":
        assert module._recorded is not None and module._recorded.steps[0].replays > 0
    else:
        assert module._recorded is None


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_recorded_updates_equal_unrecorded_ones() -> None:
    """The real recorder: three updates recorded and replayed as CUDA graphs against the
    same updates eager, within 1e-6 (cuDNN's RNN kernels may differ between a capture's
    stream and the default one), and the minibatches did replay."""
    device = torch.device("cuda")
    batch = _batches()["unbroken"].to(device)
    results = []
    for record in (False, True):
        policy = make_policy(seed=1).to(device)
        optimizer = make_optimizer(policy, CONFIG)
        recorder = step_graph.recorder_for(device) if record else None
        recorded = None if recorder is None else RecordedMinibatches(policy, CONFIG, recorder)
        for ent_coef in ENT_COEFS:
            ppo_update(
                policy, optimizer, batch, CONFIG, ent_coef=ent_coef, minibatch_passes=recorded
            )
        results.append(policy)
        if recorded is not None:
            assert recorded.steps[0].replays > 0
    for name, value in results[0].state_dict().items():
        torch.testing.assert_close(results[1].state_dict()[name], value, atol=1e-6, rtol=0)
