"""The policy's act recorded once a run and replayed (``esper.mdp.recorded_act``).

On a CPU the recorder is the tests' tape (``tests/tolaria/op_tape.py``), which holds a step
to a CUDA graph's rules and runs the same kernels, so recorded acts must equal the policy's
own bit for bit, draws included. The CUDA test runs the real recorder where a GPU is at hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from esper.mdp.recorded_act import RecordedAct
from esper.mdp.rollout import acting
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.baselines import NoGrowthController
from esper.tamiyo.policy import ActResult, PolicyNetwork
from esper.tolaria import step_graph
from tests.tamiyo.factories import OBS_DIM, make_policy, random_masks
from tests.tolaria.op_tape import TapeRecorder

N_ENVS = 5
STEPS = 8


def episode(
    act: object, policy: PolicyNetwork, deterministic: bool = False, device: str = "cpu"
) -> list[ActResult]:
    """``STEPS`` acts of ``act`` (the policy's own, or a recorded one) from the same
    observations and masks and the same generator state, each step's hidden state the
    last one's: what a rollout does. Every result is kept, as the rollout keeps them."""
    g = torch.Generator().manual_seed(1)
    inputs = [
        (torch.randn(N_ENVS, OBS_DIM, generator=g).to(device), random_masks((N_ENVS,), g))
        for _ in range(STEPS)
    ]
    torch.manual_seed(7)  # the draws' generator
    hidden = policy.initial_state(N_ENVS, device)
    results = []
    for obs, masks in inputs:
        masks = ActionMasks(
            *(getattr(masks, f).to(device) for f in ("op", "slot", "blueprint", "blend"))
        )
        result = act(obs, hidden, masks, deterministic=deterministic)  # type: ignore[operator]
        results.append(result)
        hidden = result.hidden
    return results


def assert_equal_acts(a: list[ActResult], b: list[ActResult]) -> None:
    for t, (x, y) in enumerate(zip(a, b, strict=True)):
        for name, u, v in (
            ("actions", x.actions, y.actions),
            ("log_prob", x.log_prob, y.log_prob),
            ("entropy", x.entropy, y.entropy),
            ("value", x.value, y.value),
            ("h", x.hidden[0], y.hidden[0]),
            ("c", x.hidden[1], y.hidden[1]),
        ):
            assert torch.equal(u.cpu(), v.cpu()), f"step {t}: {name} differs"


@pytest.mark.parametrize("deterministic", [False, True])
def test_recorded_acts_equal_the_policys_own_bit_for_bit_and_keep_what_they_handed_back(
    deterministic: bool,
) -> None:
    """The first act runs as it is, the second warms the act's own recorder up, the third
    is recorded; the rest replay. Draws equal the eager ones (the recording draws none),
    and results handed back earlier are not overwritten by later replays."""
    policy = make_policy()
    plain = episode(policy.act, policy, deterministic)
    recorder = TapeRecorder()
    recorded_act = RecordedAct(policy, recorder)
    recorded = episode(recorded_act, policy, deterministic)
    assert_equal_acts(plain, recorded)
    step = recorded_act.steps[deterministic]
    assert (step.unrecorded, step.recordings, step.replays) == (2, 1, STEPS - 2)
    # A second episode (the next rollout) replays from its first act.
    again = episode(recorded_act, policy, deterministic)
    assert_equal_acts(plain, again)
    assert (step.recordings, step.replays) == (1, 2 * STEPS - 2)


def test_an_act_replays_on_the_policys_weights_as_they_are_after_an_update() -> None:
    """The optimizer steps the policy's parameters in place: a later replay acts with the
    new weights, as the policy's own act does."""
    policy = make_policy()
    recorded_act = RecordedAct(policy, TapeRecorder())
    episode(recorded_act, policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(0.9).add_(0.01)
    assert_equal_acts(episode(policy.act, policy), episode(recorded_act, policy))


def test_an_act_with_its_own_generator_or_episode_starts_runs_as_it_is() -> None:
    policy = make_policy()
    recorded_act = RecordedAct(policy, TapeRecorder())
    g = torch.Generator().manual_seed(0)
    masks = random_masks((N_ENVS,), g)
    obs = torch.randn(N_ENVS, OBS_DIM, generator=g)
    hidden = policy.initial_state(N_ENVS)
    starts = torch.ones(N_ENVS, dtype=torch.bool)
    for _ in range(4):
        recorded_act(obs, hidden, masks, generator=torch.Generator().manual_seed(3))
        recorded_act(obs, hidden, masks, episode_starts=starts)
    assert recorded_act.steps == {}
    a = recorded_act(obs, hidden, masks, generator=torch.Generator().manual_seed(3))
    b = policy.act(obs, hidden, masks, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.actions, b.actions) and torch.equal(a.log_prob, b.log_prob)


def test_an_act_under_autocast_runs_as_it_is() -> None:
    """A mixed-precision fit acts inside Lightning's autocast, whose cache of cast weights
    a recording cannot hold (it would replay casts of weights since updated)."""
    policy = make_policy()
    recorded_act = RecordedAct(policy, TapeRecorder())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = episode(policy.act, policy)
        recorded = episode(recorded_act, policy)
    assert recorded_act.steps == {}
    assert_equal_acts(plain, recorded)


class _ReadingPolicy(PolicyNetwork):
    """A plugin policy whose act reads the device on the host: no graph can hold it."""

    def act(self, obs, hidden, masks, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if obs.sum().item() > 1e30:
            raise AssertionError("unreachable")
        return super().act(obs, hidden, masks, *args, **kwargs)


def test_an_act_that_cannot_be_recorded_warns_runs_as_it_is_and_host_steps_still_record(
    taped: list[TapeRecorder],
) -> None:
    torch.manual_seed(0)
    reading = _ReadingPolicy(OBS_DIM, make_policy().schema, make_policy().config)
    reading.load_state_dict(make_policy().state_dict())
    act = acting(reading, compile=False, cuda_graphs=True)
    assert isinstance(act, RecordedAct)
    with pytest.warns(RuntimeWarning, match="the policy's act could not be recorded"):
        results = episode(act, reading)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later acts just run
        episode(act, reading)
    assert_equal_acts(episode(reading.act, reading), results)
    host_steps = step_graph.recorder_for(torch.device("cpu"))
    assert host_steps is not None and host_steps.refused is None
    assert act.steps[False].recordings == 0


def test_acting_records_a_policy_network_where_asked_and_its_device_records(
    taped: list[TapeRecorder],
) -> None:
    policy = make_policy()
    assert isinstance(acting(policy, compile=False, cuda_graphs=True), RecordedAct)
    assert acting(policy, compile=False, cuda_graphs=False) == policy.act
    baseline = NoGrowthController()
    assert acting(baseline, compile=False, cuda_graphs=True) == baseline.act
    made = len(taped)
    acting(policy, compile=False, cuda_graphs=True)
    assert len(taped) == made + 1  # a recorder of its own each: not the host steps'


def test_a_device_without_a_recorder_acts_as_it_is() -> None:
    policy = make_policy()
    assert acting(policy, compile=False, cuda_graphs=True) == policy.act  # a CPU records not


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_recorded_acts_equal_the_policys_own() -> None:
    """On CUDA the draws come from the default generator, which a graph replays from its
    current offset: the same noise as eager acts, so the same actions."""
    policy = make_policy().cuda()
    plain = episode(policy.act, policy, device="cuda")
    recorder = step_graph.own_recorder(torch.device("cuda"))
    assert recorder is not None
    recorded_act = RecordedAct(policy, recorder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recorded = episode(recorded_act, policy, device="cuda")
        again = episode(recorded_act, policy, device="cuda")
    assert recorded_act.steps[False].replays == 2 * STEPS - 2
    assert_equal_acts(plain, recorded)
    assert_equal_acts(plain, again)
