"""PolicyNetwork: legal actions, op-dependent log-probs, act/evaluate agreement, no host reads."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from esper.contracts import ActionSchema, BlendMode, LifecycleOp
from esper.host_reads import HostReadCounter
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import BLEND, BLUEPRINT, OP, SLOT, PolicyConfig, PolicyNetwork
from esper.tamiyo.replay_segments import segment_layout
from tests.ops import OpCounter
from tests.tamiyo.factories import OBS_DIM, SCHEMA, make_policy, random_masks

#: One act call over this many envs draws this many samples of the factored action.
N_SAMPLE_ENVS = 1000
TOL = 1e-5


def _gather_row(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[torch.arange(len(index)), index]


def test_sampled_actions_are_always_legal() -> None:
    policy = make_policy()
    g = torch.Generator().manual_seed(0)
    masks = random_masks((N_SAMPLE_ENVS,), g)
    obs = torch.randn(N_SAMPLE_ENVS, OBS_DIM, generator=g)
    result = policy.act(obs, policy.initial_state(N_SAMPLE_ENVS), masks, generator=g)
    op, slot, blueprint, blend = result.actions.unbind(-1)
    usage = torch.tensor(ActionSchema.head_usage())[op]
    assert _gather_row(masks.op, op).all()
    slot_ok = _gather_row(_gather_row(masks.slot, op), slot)
    assert (slot_ok | ~usage[:, SLOT]).all()
    blueprint_ok = _gather_row(_gather_row(masks.blueprint, slot), blueprint)
    assert (blueprint_ok | ~usage[:, BLUEPRINT]).all()
    assert (_gather_row(masks.blend, blend) | ~usage[:, BLEND]).all()
    # Every op with a legal slot somewhere got sampled: the masks did not collapse the policy.
    assert set(op.tolist()) == {int(o) for o in LifecycleOp}


def _score(policy: PolicyNetwork, actions: torch.Tensor, masks: ActionMasks) -> torch.Tensor:
    """Log-prob of ``actions [E, 4]`` as one-step sequences from a fixed observation."""
    n_envs = actions.shape[0]
    obs = torch.ones(n_envs, 1, OBS_DIM)
    starts = torch.ones(n_envs, 1, dtype=torch.bool)
    seq_masks = masks.map(lambda m: m.unsqueeze(1))
    log_prob, _, _ = policy.evaluate(
        obs, policy.initial_state(n_envs), seq_masks, actions.unsqueeze(1), starts
    )
    return log_prob.squeeze(1)


def test_heads_an_op_does_not_use_do_not_change_its_log_prob() -> None:
    policy = make_policy()
    masks = ActionMasks.all_legal(SCHEMA, (2,))
    wait = torch.tensor([[LifecycleOp.WAIT, 0, 0, 0], [LifecycleOp.WAIT, 2, 3, 1]])
    advance = torch.tensor([[LifecycleOp.ADVANCE, 1, 0, 0], [LifecycleOp.ADVANCE, 1, 3, 2]])
    germinate = torch.tensor([[LifecycleOp.GERMINATE, 1, 0, 0], [LifecycleOp.GERMINATE, 1, 3, 2]])
    with torch.no_grad():
        wait_lp, advance_lp, germinate_lp = (
            _score(policy, a, masks) for a in (wait, advance, germinate)
        )
    assert wait_lp[0] == wait_lp[1]
    assert advance_lp[0] == advance_lp[1]
    assert germinate_lp[0] != germinate_lp[1]
    # Narrowing the masks of heads ADVANCE does not use leaves its log-prob alone too.
    narrowed = ActionMasks.all_legal(SCHEMA, (2,))
    narrowed.blueprint[:, :, 1:] = False
    narrowed.blend[:, 1:] = False
    with torch.no_grad():
        assert torch.equal(_score(policy, advance, narrowed), advance_lp)
        assert not torch.equal(_score(policy, germinate, narrowed), germinate_lp)


def test_only_legal_op_and_unused_heads_give_log_prob_zero() -> None:
    policy = make_policy()
    masks = ActionMasks.all_legal(SCHEMA, (3,))
    masks.op[:] = False
    masks.op[:, LifecycleOp.WAIT] = True
    result = policy.act(torch.randn(3, OBS_DIM), policy.initial_state(3), masks)
    assert (result.actions[:, OP] == LifecycleOp.WAIT).all()
    assert torch.equal(result.log_prob, torch.zeros(3))
    assert torch.equal(result.entropy, torch.zeros(3))


def test_deterministic_takes_the_most_likely_legal_choice() -> None:
    policy = make_policy()
    n_ops, n_slots = policy.n_ops, policy.n_slots
    with torch.no_grad():
        for head in (policy.op_head, policy.slot_head, policy.blueprint_head, policy.blend_head):
            head.weight.zero_()
            head.bias.zero_()
        policy.op_head.bias.copy_(torch.tensor([0.0, 3.0, 1.0, 5.0]))  # PRUNE best, masked below
        slot_bias = torch.zeros(n_ops, n_slots)
        slot_bias[LifecycleOp.GERMINATE] = torch.tensor([2.0, 1.0, 0.0])  # s0 best, masked
        policy.slot_head.bias.copy_(slot_bias.flatten())
        blueprint_bias = torch.zeros(n_slots, policy.n_blueprints)
        blueprint_bias[1] = torch.tensor([0.0, 1.0, 4.0, 2.0])
        policy.blueprint_head.bias.copy_(blueprint_bias.flatten())
        policy.blend_head.bias.copy_(torch.tensor([0.0, 0.0, 9.0, 1.0]))  # SIGMOID, masked
    masks = ActionMasks.all_legal(SCHEMA, (1,))
    masks.op[0, LifecycleOp.PRUNE] = False
    masks.slot[0, LifecycleOp.GERMINATE, 0] = False
    masks.blend[0, BlendMode.SIGMOID] = False
    obs = torch.randn(1, OBS_DIM)
    result = policy.act(obs, policy.initial_state(1), masks, deterministic=True)
    expected = [LifecycleOp.GERMINATE, 1, 2, BlendMode.GATED]
    assert result.actions[0].tolist() == [int(a) for a in expected]


def _rollout(
    policy: PolicyNetwork, n_envs: int, n_steps: int, seed: int, resets_after_start: bool = True
) -> tuple[dict[str, torch.Tensor], ActionMasks, tuple[torch.Tensor, torch.Tensor]]:
    """Act for ``n_steps`` with random masks and random episode starts (with
    ``resets_after_start`` False: at step 0 only, as one episode a rollout); stack what a
    buffer keeps."""
    g = torch.Generator().manual_seed(seed)
    hidden = policy.initial_state(n_envs)
    # A non-zero start state, as a rollout that continues an earlier one would have.
    hidden = tuple(torch.randn(s.shape, generator=g) for s in hidden)
    hidden0 = hidden
    keep: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("obs", "starts", "actions", "log_prob", "entropy", "value")
    }
    step_masks = []
    for _ in range(n_steps):
        obs = torch.randn(n_envs, OBS_DIM, generator=g)
        starts = torch.rand(n_envs, generator=g) < 0.3
        if not resets_after_start:
            starts.fill_(len(step_masks) == 0)
        masks = random_masks((n_envs,), g)
        result = policy.act(obs, hidden, masks, episode_starts=starts, generator=g)
        hidden = result.hidden
        for key, value in (
            ("obs", obs),
            ("starts", starts),
            ("actions", result.actions),
            ("log_prob", result.log_prob),
            ("entropy", result.entropy),
            ("value", result.value),
        ):
            keep[key].append(value)
        step_masks.append(masks)
    stacked = {k: torch.stack(v, dim=1) for k, v in keep.items()}
    return stacked, ActionMasks.stack(step_masks), hidden0


def test_evaluate_replays_act_exactly_including_episode_resets() -> None:
    policy = make_policy()
    data, masks, hidden0 = _rollout(policy, n_envs=5, n_steps=7, seed=2)
    assert data["starts"][:, 1:].any(), "the test needs resets after step 0"
    log_prob, entropy, value = policy.evaluate(
        data["obs"], hidden0, masks, data["actions"], data["starts"]
    )
    torch.testing.assert_close(log_prob, data["log_prob"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(entropy, data["entropy"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(value, data["value"], atol=TOL, rtol=TOL)
    # The resets matter: ignoring them changes the values.
    _, _, value_no_reset = policy.evaluate(
        data["obs"], hidden0, masks, data["actions"], torch.zeros_like(data["starts"])
    )
    assert not torch.allclose(value_no_reset, data["value"], atol=TOL)


@pytest.mark.parametrize("layers", [1, 2])
def test_an_unbroken_replay_runs_the_lstm_in_one_call_as_act_stepped_it(layers: int) -> None:
    """With no reset after step 0 and no restart, ``unbroken`` replays whole sequences in
    one fused LSTM call: act's figures, and the step loop's gradients, within rounding."""
    policy = make_policy(config=PolicyConfig(hidden_size=32, lstm_layers=layers))
    data, masks, hidden0 = _rollout(policy, 5, 7, seed=4, resets_after_start=False)
    assert data["starts"][:, 0].all() and not data["starts"][:, 1:].any()
    replays = []
    for unbroken in (False, True):
        policy.zero_grad()
        log_prob, entropy, value = policy.evaluate(
            data["obs"], hidden0, masks, data["actions"], data["starts"], breaks=_unbroken(unbroken)
        )
        torch.testing.assert_close(log_prob, data["log_prob"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(entropy, data["entropy"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(value, data["value"], atol=TOL, rtol=TOL)
        (log_prob.sum() + entropy.sum() + value.sum()).backward()
        replays.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    stepped, fused = replays
    assert any(n.startswith("lstm") for n in fused)
    for name, grad in stepped.items():
        torch.testing.assert_close(fused[name], grad, atol=TOL, rtol=TOL, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_unbroken_replay_is_the_step_loop_within_rounding() -> None:
    """cuDNN runs the fused replay there (copying the cells' weights into one block, which
    it would warn about each call); its figures and gradients are the loop's."""
    policy = make_policy(config=PolicyConfig(hidden_size=32, lstm_layers=2))
    data, masks, hidden0 = _rollout(policy, 5, 7, seed=6, resets_after_start=False)
    args = (data["obs"], hidden0, masks, data["actions"], data["starts"])
    _same_on_cuda_as_the_step_loop(policy, args, {}, {"breaks": _unbroken(True)})


def _same_on_cuda_as_the_step_loop(
    policy: PolicyNetwork, args: tuple, stepped: dict, fused: dict, device: str = "cuda"
) -> None:
    """``policy.evaluate(*args, **stepped)`` and ``(*args, **fused)`` on ``device``
    (everything moved there) give the same figures and gradients within 1e-4, and warn of
    nothing."""
    policy = policy.to(device)

    def moved(value: object) -> object:
        if isinstance(value, tuple):
            return tuple(moved(v) for v in value)
        return value.to(device) if isinstance(value, torch.Tensor | ActionMasks) else value

    args = tuple(moved(a) for a in args)
    replays = []
    for kwargs in (stepped, fused):
        policy.zero_grad()
        # TF32 off, the backward included: cuDNN's RNN would use it by default (about 1e-4
        # in a gradient, seen on an H100), the loop's matmuls not.
        with warnings.catch_warnings(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            warnings.simplefilter("error")  # no warning reaches the user from the call
            figures = policy.evaluate(*args, **{k: moved(v) for k, v in kwargs.items()})
            sum(f.sum() for f in figures).backward()
        replays.append((figures, {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (loop, loop_grads), (call, call_grads) = replays
    for a, b in zip(loop, call, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(call_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def test_an_unbroken_replay_launches_a_few_lstm_ops_not_a_loop_of_them() -> None:
    policy = make_policy(config=PolicyConfig(hidden_size=32))
    data, masks, hidden0 = _rollout(policy, 5, 12, seed=5, resets_after_start=False)
    counts = []
    for unbroken in (False, True):
        with OpCounter() as ops:
            log_prob, _, value = policy.evaluate(
                data["obs"],
                hidden0,
                masks,
                data["actions"],
                data["starts"],
                breaks=_unbroken(unbroken),
            )
            (log_prob.sum() + value.sum()).backward()
        counts.append(ops.total)
    # The step loop's ops, forward and backward, grow with the 12 steps; the call's do not.
    assert counts[1] < counts[0] - 10 * 12, counts


def _unbroken(known: bool) -> tuple[tuple[int, ...], ...] | None:
    """The breaks of the 5 envs of an unbroken rollout, where the caller says it knows."""
    return ((),) * 5 if known else None


def _restarted_rollout(
    policy: PolicyNetwork, n_envs: int, n_steps: int, seed: int
) -> tuple[dict[str, torch.Tensor], ActionMasks, tuple[torch.Tensor, torch.Tensor]]:
    """Act with random governor restarts (a step acting from a stored state) and episode
    starts, a restart and a start on one step included; what a buffer keeps, with the
    states each step acted from, ``(h, c)`` each ``[E, T, layers, H]``."""
    g = torch.Generator().manual_seed(seed)
    restarts = torch.rand(n_envs, n_steps, generator=g) < 0.4
    starts = torch.rand(n_envs, n_steps, generator=g) < 0.2
    restarts[0, 2], starts[0, 2] = True, True
    restarts[1, 3], starts[1, 3] = True, False
    restarts[2, 1:], starts[2, 1:] = False, False  # one env unbroken
    hidden = policy.initial_state(n_envs)
    keep: dict[str, list[torch.Tensor]] = {k: [] for k in ("obs", "actions", "log_prob", "value")}
    step_masks, acted_from = [], []
    for t in range(n_steps):
        stored = tuple(torch.randn(s.shape, generator=g) for s in hidden)
        flag = restarts[:, t].view(1, -1, 1)
        hidden = tuple(torch.where(flag, x, h) for x, h in zip(stored, hidden, strict=True))
        obs = torch.randn(n_envs, OBS_DIM, generator=g)
        masks = random_masks((n_envs,), g)
        result = policy.act(obs, hidden, masks, episode_starts=starts[:, t], generator=g)
        acted_from.append(hidden)
        hidden = result.hidden
        for key, value in (
            ("obs", obs),
            ("actions", result.actions),
            ("log_prob", result.log_prob),
            ("value", result.value),
        ):
            keep[key].append(value)
        step_masks.append(masks)
    data = {k: torch.stack(v, dim=1) for k, v in keep.items()}
    data["starts"], data["restarts"] = starts, restarts
    # As the buffer stores them: [E, T, layers, H].
    stored_hidden = tuple(
        torch.stack([state[i] for state in acted_from], 1).permute(2, 1, 0, 3) for i in (0, 1)
    )
    return data, ActionMasks.stack(step_masks), stored_hidden  # type: ignore[return-value]


def _breaks(data: dict[str, torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """Per env, the steps after 0 flagged a restart or an episode start (``PPOBatch.breaks``)."""
    broken = (data["starts"] | data["restarts"])[:, 1:]
    return tuple(tuple(int(t) + 1 for t in row.nonzero().flatten()) for row in broken)


def _replayed(
    policy: PolicyNetwork,
    data: dict[str, torch.Tensor],
    masks: ActionMasks,
    stored: tuple[torch.Tensor, torch.Tensor],
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``policy.evaluate`` of a :func:`_restarted_rollout`, from its step 0's stored state."""
    hidden0 = tuple(s[:, 0].transpose(0, 1) for s in stored)
    return policy.evaluate(
        data["obs"],
        hidden0,
        masks,
        data["actions"],
        data["starts"],
        **kwargs,  # type: ignore[arg-type]
    )


def test_evaluate_starts_flagged_steps_from_their_stored_state() -> None:
    """After a governor restore an env acts from a stored state, not from its previous
    step's output; given the flags and the stored states, the replay matches act, also
    where a restart and an episode start fall on the same step (act reset after)."""
    policy = make_policy(config=PolicyConfig(hidden_size=32, lstm_layers=2))
    data, masks, stored_hidden = _restarted_rollout(policy, 4, 6, seed=3)

    def replay(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_prob, _, value = _replayed(
            policy, data, masks, stored_hidden, hidden_restarts=flags, stored_hidden=stored_hidden
        )
        return log_prob, value

    log_prob, value = replay(data["restarts"])
    torch.testing.assert_close(log_prob, data["log_prob"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(value, data["value"], atol=TOL, rtol=TOL)
    _, chained = replay(torch.zeros_like(data["restarts"]))
    assert not torch.allclose(chained, data["value"], atol=TOL)
    with pytest.raises(ValueError, match="together"):
        _replayed(policy, data, masks, stored_hidden, hidden_restarts=data["restarts"])


@pytest.mark.parametrize("layers", [1, 2])
def test_a_replay_cut_at_its_breaks_runs_the_lstm_in_one_call_as_the_step_loop_does(
    layers: int,
) -> None:
    """Told where each env's chain of states breaks (``breaks``), the replay runs the
    stretches between in one fused LSTM call, each from its stored state: act's figures,
    and the step loop's gradients, within rounding, in fewer ops."""
    policy = make_policy(config=PolicyConfig(hidden_size=32, lstm_layers=layers))
    data, masks, stored_hidden = _restarted_rollout(policy, 4, 9, seed=7)
    breaks = _breaks(data)
    assert breaks[2] == () and all(breaks[e] for e in (0, 1, 3))
    replays, counts = [], []
    for known in (None, breaks):
        policy.zero_grad()
        with OpCounter() as ops:
            log_prob, entropy, value = _replayed(
                policy,
                data,
                masks,
                stored_hidden,
                hidden_restarts=data["restarts"],
                stored_hidden=stored_hidden,
                breaks=known,
            )
            (log_prob.sum() + entropy.sum() + value.sum()).backward()
        counts.append(ops.total)
        torch.testing.assert_close(log_prob, data["log_prob"], atol=TOL, rtol=TOL)
        torch.testing.assert_close(value, data["value"], atol=TOL, rtol=TOL)
        replays.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    stepped, segmented = replays
    for name, grad in stepped.items():
        torch.testing.assert_close(segmented[name], grad, atol=TOL, rtol=TOL, msg=name)
    assert counts[1] < counts[0] / 2, counts
    with pytest.raises(ValueError, match="stored_hidden"):
        _replayed(policy, data, masks, stored_hidden, breaks=breaks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_replay_cut_at_its_breaks_is_the_step_loop_within_rounding() -> None:
    """cuDNN runs the segments' call there, from the stored states gathered on the device
    and an index uploaded from pinned memory; figures and gradients are the loop's."""
    policy = make_policy(config=PolicyConfig(hidden_size=32, lstm_layers=2))
    data, masks, stored_hidden = _restarted_rollout(policy, 4, 9, seed=8)
    hidden0 = tuple(s[:, 0].transpose(0, 1).contiguous() for s in stored_hidden)
    args = (data["obs"], hidden0, masks, data["actions"], data["starts"])
    restarts = {"hidden_restarts": data["restarts"], "stored_hidden": stored_hidden}
    _same_on_cuda_as_the_step_loop(policy, args, restarts, {**restarts, "breaks": _breaks(data)})


@pytest.mark.parametrize("breaks", [((0,),), ((3, 2),), ((2, 2),), ((5,),)])
def test_breaks_outside_a_sequence_or_out_of_order_are_refused(breaks: tuple) -> None:
    with pytest.raises(ValueError, match=r"env 0: breaks must ascend strictly within \[1, 5\)"):
        segment_layout(breaks, 5, torch.device("cpu"))


def test_act_and_evaluate_make_no_host_reads() -> None:
    policy = make_policy()
    n_envs, n_steps = 4, 3
    g = torch.Generator().manual_seed(0)
    masks = random_masks((n_envs,), g)
    seq_masks = random_masks((n_envs, n_steps), g)
    obs = torch.randn(n_envs, OBS_DIM)
    starts = torch.tensor([True, False, True, False])
    hidden = policy.initial_state(n_envs)
    with HostReadCounter() as counter:
        result = policy.act(obs, hidden, masks, episode_starts=starts, generator=g)
        policy.act(obs, result.hidden, masks, deterministic=True)
        policy.value(obs, result.hidden)
        seq_obs = obs.unsqueeze(1).expand(n_envs, n_steps, OBS_DIM)
        seq_actions = result.actions.unsqueeze(1).expand(n_envs, n_steps, 4)
        seq_starts = starts.unsqueeze(1).expand(n_envs, n_steps)
        restarts = {
            "hidden_restarts": ~seq_starts,
            "stored_hidden": tuple(
                s.transpose(0, 1).unsqueeze(1).expand(n_envs, n_steps, *s.shape[::2])
                for s in result.hidden
            ),
        }
        first_only = (torch.arange(n_steps) == 0).expand(n_envs, n_steps)
        for starts_at, extra in (
            (seq_starts, restarts),  # step by step
            (first_only, {"breaks": ((),) * n_envs}),  # the replay in one LSTM call
            (seq_starts, {**restarts, "breaks": ((1, 2),) * n_envs}),  # cut at the breaks
        ):
            log_prob, entropy, value = policy.evaluate(
                seq_obs, hidden, seq_masks, seq_actions, starts_at, **extra
            )
            (log_prob.sum() + entropy.sum() + value.sum()).backward()
    assert counter.count == 0, counter.report()


def test_shapes() -> None:
    config = PolicyConfig(hidden_size=16, lstm_layers=2)
    policy = PolicyNetwork(OBS_DIM, SCHEMA, config)
    h, c = policy.initial_state(3)
    assert h.shape == c.shape == (2, 3, 16)
    result = policy.act(torch.randn(3, OBS_DIM), (h, c), ActionMasks.all_legal(SCHEMA, (3,)))
    assert result.actions.shape == (3, 4) and result.actions.dtype == torch.long
    assert result.log_prob.shape == result.value.shape == result.entropy.shape == (3,)
    assert result.hidden[0].shape == (2, 3, 16)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 0),
        ("lstm_layers", 0),
        ("encoder_layers", 1.5),
        ("policy_head_init_gain", 0.0),
        ("prune_logit_init", float("nan")),
        ("cpu_threads", 0),
        ("cpu_threads", 1.0),
    ],
)
def test_policy_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"PolicyConfig.{field}"):
        PolicyConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [0.0, -2.0])
def test_the_first_policy_prunes_as_prune_logit_init_says(bias: float) -> None:
    """Every other op starts near logit 0, so p(PRUNE) / p(WAIT) is exp(bias) when legal."""
    policy = make_policy(config=PolicyConfig(hidden_size=16, prune_logit_init=bias))
    lstm_out = torch.rand(N_SAMPLE_ENVS, 16) * 2 - 1  # an LSTM's output lies in (-1, 1)
    with torch.no_grad():
        probs = torch.softmax(policy.op_head(lstm_out), dim=-1)
    ratio = (probs[:, LifecycleOp.PRUNE] / probs[:, LifecycleOp.WAIT]).mean().item()
    assert ratio == pytest.approx(math.exp(bias), rel=0.05)


def test_action_masks_helpers_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [random_masks((3,), g) for _ in range(4)]
    stacked = ActionMasks.stack(steps)
    assert tuple(stacked.batch_shape) == (3, 4)
    assert torch.equal(stacked.index_time(2).slot, steps[2].slot)
    picked = stacked.index_envs(torch.tensor([2, 0]))
    assert torch.equal(picked.blueprint[1], stacked.blueprint[0])
    assert stacked.to("cpu").op.device.type == "cpu"


def test_action_masks_reject_bad_shapes_and_dtypes() -> None:
    masks = ActionMasks.all_legal(SCHEMA, (2,))
    with pytest.raises(ValueError, match=r"ActionMasks\.slot"):
        ActionMasks(masks.op, masks.slot[:, :2], masks.blueprint, masks.blend)
    with pytest.raises(TypeError, match=r"ActionMasks\.blend"):
        ActionMasks(masks.op, masks.slot, masks.blueprint, masks.blend.float())
