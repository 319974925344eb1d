"""compute_gae, its tensor-ops solver and its input checks against a per-env, per-step reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.host_reads import HostReadCounter
from esper.simic import gae, gae_native
from esper.simic.gae import compute_gae

TOL = 1e-6
#: Hypothesis examples per property: enough to hit odd done patterns, fast on CPU.
EXAMPLES = 60


def reference_gae(
    rewards: list[list[float]],
    values: list[list[float]],
    next_values: list[list[float]],
    terminated: list[list[bool]],
    done: list[list[bool]],
    gamma: float,
    gae_lambda: float,
) -> tuple[list[list[float]], list[list[float]]]:
    """The textbook recursion, one env and one step at a time, on Python floats."""
    advantages: list[list[float]] = []
    returns: list[list[float]] = []
    for e in range(len(rewards)):
        n_steps = len(rewards[e])
        adv = [0.0] * n_steps
        following = 0.0
        for t in reversed(range(n_steps)):
            bootstrap = 0.0 if terminated[e][t] else gamma * next_values[e][t]
            delta = rewards[e][t] + bootstrap - values[e][t]
            if done[e][t] or terminated[e][t]:
                following = 0.0
            adv[t] = delta + gamma * gae_lambda * following
            following = adv[t]
        advantages.append(adv)
        returns.append([a + v for a, v in zip(adv, values[e], strict=True)])
    return advantages, returns


def make_batch(
    n_envs: int,
    n_steps: int,
    seed: int,
    p_terminated: float = 0.1,
    p_truncated: float = 0.1,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """Random rewards/values with random terminations and truncations (done ⊇ terminated)."""
    g = torch.Generator().manual_seed(seed)
    terminated = torch.rand(n_envs, n_steps, generator=g) < p_terminated
    truncated = torch.rand(n_envs, n_steps, generator=g) < p_truncated
    return {
        "rewards": torch.randn(n_envs, n_steps, generator=g, dtype=dtype),
        "values": torch.randn(n_envs, n_steps, generator=g, dtype=dtype),
        "next_values": torch.randn(n_envs, n_steps, generator=g, dtype=dtype),
        "terminated": terminated,
        "done": terminated | truncated,
    }


def as_lists(batch: dict[str, torch.Tensor]) -> dict[str, list]:
    return {k: v.tolist() for k, v in batch.items()}


rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    n_envs=st.integers(1, 8),
    n_steps=st.integers(1, 30),
    gamma=rates,
    gae_lambda=rates,
    p_terminated=st.sampled_from([0.0, 0.1, 0.5]),
    p_truncated=st.sampled_from([0.0, 0.1, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_per_env_per_step_reference_with_terminations_and_truncations(
    n_envs: int,
    n_steps: int,
    gamma: float,
    gae_lambda: float,
    p_terminated: float,
    p_truncated: float,
    seed: int,
) -> None:
    batch = make_batch(n_envs, n_steps, seed, p_terminated, p_truncated)
    adv, ret = compute_gae(**batch, gamma=gamma, gae_lambda=gae_lambda)
    ref_adv, ref_ret = reference_gae(**as_lists(batch), gamma=gamma, gae_lambda=gae_lambda)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=adv.dtype), atol=TOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=ret.dtype), atol=TOL, rtol=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    n_envs=st.integers(1, 6),
    # 1..3 (degenerate chunks), squares (no tail) and primes (a tail of up to chunk - 1).
    n_steps=st.sampled_from([1, 2, 3, 4, 7, 9, 16, 23, 25, 36, 49, 61, 100]),
    gamma=rates,
    gae_lambda=rates,
    p_stop=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_chunked_sweep_matches_the_reference_for_any_length(
    n_envs: int,
    n_steps: int,
    gamma: float,
    gae_lambda: float,
    p_stop: float,
    seed: int,
) -> None:
    batch = make_batch(n_envs, n_steps, seed, p_stop, p_stop)
    adv, ret = gae._gae_by_chunks(**batch, gamma=gamma, gae_lambda=gae_lambda)
    ref_adv, ref_ret = reference_gae(**as_lists(batch), gamma=gamma, gae_lambda=gae_lambda)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=adv.dtype), atol=TOL, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=ret.dtype), atol=TOL, rtol=0)
    assert adv.is_contiguous() and ret.is_contiguous()


#: The backends that can run here: tensor ops always, the C kernel where it was built.
BACKENDS_HERE = ["torch", *(["native"] if gae_native.available() else [])]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize(("n_envs", "n_steps"), [(4, 25), (64, 150), (256, 1000)])
def test_float32_at_benchmark_shapes_is_within_1e_5_of_the_reference(
    n_envs: int, n_steps: int, backend: str
) -> None:
    batch = make_batch(n_envs, n_steps, seed=7, p_terminated=0.05, p_truncated=0.05)
    ref_adv, ref_ret = compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="torch")
    as_float32 = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    adv, ret = compute_gae(**as_float32, gamma=0.99, gae_lambda=0.95, backend=backend)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-5, rtol=0)


def test_non_contiguous_inputs_give_contiguous_results_equal_to_contiguous_ones() -> None:
    batch = make_batch(40, 90, seed=4)
    transposed = {k: v.T.contiguous().T for k, v in batch.items()}
    assert not transposed["rewards"].is_contiguous()
    expected = gae._gae_by_chunks(**batch, gamma=0.97, gae_lambda=0.9)
    got = gae._gae_by_chunks(**transposed, gamma=0.97, gae_lambda=0.9)
    for a, b in zip(got, expected, strict=True):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_float32_inputs_match_the_reference_and_keep_their_dtype() -> None:
    batch = make_batch(16, 25, seed=3, dtype=torch.float32)
    adv, ret = compute_gae(**batch, gamma=0.99, gae_lambda=0.95)
    ref_adv, _ = reference_gae(**as_lists(batch), gamma=0.99, gae_lambda=0.95)
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.is_contiguous() and ret.is_contiguous()
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float32), atol=TOL, rtol=0)


def test_a_terminated_step_missing_from_done_still_stops_the_recursion() -> None:
    batch = make_batch(4, 12, seed=5, p_terminated=0.3, p_truncated=0.0)
    with_done, _ = compute_gae(**batch, gamma=0.9, gae_lambda=0.8)
    batch["done"] = torch.zeros_like(batch["done"])
    without_done, _ = compute_gae(**batch, gamma=0.9, gae_lambda=0.8)
    assert batch["terminated"].any()
    torch.testing.assert_close(with_done, without_done, atol=0, rtol=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), gamma=rates)
def test_lambda_zero_gives_one_step_td_errors(seed: int, gamma: float) -> None:
    batch = make_batch(5, 17, seed, p_terminated=0.2, p_truncated=0.2)
    adv, ret = compute_gae(**batch, gamma=gamma, gae_lambda=0.0)
    bootstrap = torch.where(batch["terminated"], 0.0, gamma * batch["next_values"])
    td = batch["rewards"] + bootstrap - batch["values"]
    torch.testing.assert_close(adv, td, atol=TOL, rtol=0)
    torch.testing.assert_close(ret, batch["rewards"] + bootstrap, atol=TOL, rtol=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_no_dones_and_unit_rates_give_reward_to_go_plus_bootstrap_minus_values(seed: int) -> None:
    batch = make_batch(6, 20, seed, p_terminated=0.0, p_truncated=0.0)
    # Inside an episode the caller passes V(s_{t+1}) = values[:, t + 1]; only the last is free.
    batch["next_values"][:, :-1] = batch["values"][:, 1:]
    adv, ret = compute_gae(**batch, gamma=1.0, gae_lambda=1.0)
    rewards_to_go = batch["rewards"].flip(1).cumsum(1).flip(1)
    final_bootstrap = batch["next_values"][:, -1:]
    torch.testing.assert_close(
        adv, rewards_to_go + final_bootstrap - batch["values"], atol=TOL, rtol=0
    )
    torch.testing.assert_close(ret, rewards_to_go + final_bootstrap, atol=TOL, rtol=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), env=st.integers(0, 7))
def test_changing_one_envs_data_leaves_the_other_envs_advantages_unchanged(
    seed: int, env: int
) -> None:
    batch = make_batch(8, 15, seed)
    before, _ = compute_gae(**batch, gamma=0.97, gae_lambda=0.9)
    other = make_batch(8, 15, seed + 1)
    changed = {k: v.clone() for k, v in batch.items()}
    for k in changed:
        changed[k][env] = other[k][env]
    after, _ = compute_gae(**changed, gamma=0.97, gae_lambda=0.9)
    keep = [e for e in range(8) if e != env]
    torch.testing.assert_close(after[keep], before[keep], atol=0, rtol=0)
    assert not torch.equal(after[env], before[env])


def test_a_truncated_step_bootstraps_but_does_not_carry_the_next_episode_back() -> None:
    # One env, episode A = steps 0..1 truncated at 1, episode B = step 2. gamma = lambda = 1.
    rewards = torch.tensor([[1.0, 2.0, 100.0]])
    values = torch.tensor([[0.5, 0.25, 7.0]])
    next_values = torch.tensor([[0.25, 10.0, 3.0]])  # 10.0: the critic at the truncation
    terminated = torch.tensor([[False, False, True]])
    done = torch.tensor([[False, True, True]])
    adv, _ = compute_gae(rewards, values, next_values, terminated, done, 1.0, 1.0)
    # Step 1: 2 + 10 - 0.25; step 0: 1 + 0.25 - 0.5 + step 1; step 2: 100 - 7 (no bootstrap).
    expected = torch.tensor([[0.75 + 11.75, 11.75, 93.0]])
    torch.testing.assert_close(adv, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("shape", [(4, 25), (64, 150)])
def test_tensor_ops_read_nothing_on_the_host_and_build_no_graph(shape: tuple[int, int]) -> None:
    """The tensor-ops solver is the one CUDA runs, so this CPU run stands in for the GPU's."""
    batch = make_batch(*shape, seed=9, dtype=torch.float32)
    batch["values"].requires_grad_(True)
    with HostReadCounter() as counter:
        adv, ret = compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="torch")
    assert counter.count == 0, counter.report()
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("name", ["values", "next_values", "terminated", "done"])
def test_an_input_of_the_wrong_shape_is_rejected_by_name(name: str) -> None:
    batch = make_batch(3, 5, seed=0)
    batch[name] = batch[name][:, :4]
    with pytest.raises(ValueError, match=rf"compute_gae: {name} must have the shape of rewards"):
        compute_gae(**batch, gamma=0.99, gae_lambda=0.95)


def test_rewards_that_are_not_two_dimensional_are_rejected() -> None:
    batch = make_batch(3, 5, seed=0)
    batch["rewards"] = batch["rewards"].reshape(-1)
    with pytest.raises(ValueError, match=r"rewards must be a \[n_envs, T\] tensor"):
        compute_gae(**batch, gamma=0.99, gae_lambda=0.95)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("terminated", lambda t: t.float(), "terminated must be a bool tensor"),
        ("done", lambda t: t.int(), "done must be a bool tensor"),
        ("values", lambda t: t.float(), "values must have the dtype of rewards"),
        ("rewards", lambda t: t.long(), "rewards must be a floating tensor"),
    ],
)
def test_an_input_of_the_wrong_dtype_is_rejected_by_name(name: str, bad, message: str) -> None:
    batch = make_batch(3, 5, seed=0)
    batch[name] = bad(batch[name])
    with pytest.raises(ValueError, match=message):
        compute_gae(**batch, gamma=0.99, gae_lambda=0.95)


@pytest.mark.parametrize(
    ("gamma", "gae_lambda", "name"),
    [
        (1.5, 0.9, "gamma"),
        (-0.1, 0.9, "gamma"),
        (0.9, float("nan"), "gae_lambda"),
        (0.9, True, "gae_lambda"),
    ],
)
def test_rates_outside_the_unit_interval_are_rejected(gamma, gae_lambda, name: str) -> None:
    batch = make_batch(2, 3, seed=0)
    with pytest.raises(ValueError, match=rf"{name} must be a number in \[0, 1\]"):
        compute_gae(**batch, gamma=gamma, gae_lambda=gae_lambda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(64, 25), (256, 200)])
def test_on_cuda_matches_cpu_and_reads_nothing_on_the_host(shape: tuple[int, int]) -> None:
    batch = make_batch(*shape, seed=11, p_terminated=0.1, p_truncated=0.1, dtype=torch.float32)
    cpu_adv, cpu_ret = compute_gae(**batch, gamma=0.99, gae_lambda=0.95)
    on_gpu = {k: v.cuda() for k, v in batch.items()}
    with HostReadCounter() as counter:
        adv, ret = compute_gae(**on_gpu, gamma=0.99, gae_lambda=0.95)
    assert counter.count == 0, counter.report()
    assert adv.device.type == "cuda" and ret.device.type == "cuda"
    torch.testing.assert_close(adv.cpu(), cpu_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu(), cpu_ret, atol=1e-5, rtol=1e-5)
