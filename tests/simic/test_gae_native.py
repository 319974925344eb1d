"""The C kernel behind compute_gae on the CPU: same numbers as the reference and the tensor ops."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.simic import gae_native
from esper.simic.gae import compute_gae
from tests.simic.test_gae import EXAMPLES, as_lists, make_batch, rates, reference_gae

needs_kernel = pytest.mark.skipif(
    not gae_native.available(),
    reason="the C kernel is not built: `pip install -e .` with a C compiler builds it",
)


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs the package, which builds it")
def test_the_kernel_is_built_where_ci_installs_the_package() -> None:
    # The build is optional so that an install never fails for want of a compiler; in CI a
    # compiler exists, so a missing kernel means the build broke and every CPU GAE would
    # quietly fall back to the slower tensor ops.
    assert gae_native.available(), "esper.simic._gae_kernel did not build: see pip's log"


@needs_kernel
@settings(max_examples=EXAMPLES, deadline=None)
@given(
    n_envs=st.integers(1, 6),
    n_steps=st.integers(1, 120),
    gamma=rates,
    gae_lambda=rates,
    p_stop=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_per_env_reference_in_float64(
    n_envs: int, n_steps: int, gamma: float, gae_lambda: float, p_stop: float, seed: int
) -> None:
    batch = make_batch(n_envs, n_steps, seed, p_stop, p_stop)
    adv, ret = gae_native.gae_native(**batch, gamma=gamma, gae_lambda=gae_lambda)
    ref_adv, ref_ret = reference_gae(**as_lists(batch), gamma=gamma, gae_lambda=gae_lambda)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), atol=1e-9, rtol=0)


@needs_kernel
def test_float32_is_the_rounding_of_the_exact_recursion_not_a_chain_of_roundings() -> None:
    # Accumulated in double: every output is within one float32 rounding of the float64
    # result on the same (float32) inputs, even 1000 steps into an undiscounted return.
    batch = make_batch(64, 1000, seed=3, p_terminated=0.0, p_truncated=0.0, dtype=torch.float32)
    adv, ret = gae_native.gae_native(**batch, gamma=1.0, gae_lambda=1.0)
    as_double = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    ref_adv, ref_ret = gae_native.gae_native(**as_double, gamma=1.0, gae_lambda=1.0)
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv, ref_adv.float(), atol=0, rtol=2**-23)
    torch.testing.assert_close(ret, ref_ret.float(), atol=0, rtol=2**-23)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agrees_with_the_tensor_ops_solver(dtype: torch.dtype) -> None:
    batch = make_batch(48, 333, seed=5, p_terminated=0.05, p_truncated=0.05, dtype=dtype)
    native = compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="native")
    tensor_ops = compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="torch")
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, b in zip(native, tensor_ops, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


@needs_kernel
def test_non_contiguous_inputs_give_the_contiguous_results() -> None:
    batch = make_batch(30, 70, seed=6)
    transposed = {k: v.T.contiguous().T for k, v in batch.items()}
    sliced = {k: v[:, 10:] for k, v in make_batch(30, 80, seed=6).items()}
    for inputs in (transposed, sliced):
        assert not inputs["rewards"].is_contiguous()
        got = gae_native.gae_native(**inputs, gamma=0.9, gae_lambda=0.8)
        contiguous = {k: v.contiguous() for k, v in inputs.items()}
        expected = gae_native.gae_native(**contiguous, gamma=0.9, gae_lambda=0.8)
        for a, b in zip(got, expected, strict=True):
            assert a.is_contiguous()
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@needs_kernel
def test_auto_runs_the_kernel_for_cpu_float32_and_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    kernel = gae_native.gae_native
    monkeypatch.setattr(
        gae_native, "gae_native", lambda *a, **k: calls.append(a[0].dtype) or kernel(*a, **k)
    )
    for dtype in (torch.float32, torch.float64):
        compute_gae(**make_batch(3, 9, seed=0, dtype=dtype), gamma=0.99, gae_lambda=0.95)
    assert calls == [torch.float32, torch.float64]


def test_auto_uses_tensor_ops_for_dtypes_the_kernel_has_no_loop_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gae_native, "gae_native", lambda *a, **k: pytest.fail("kernel ran"))
    batch = make_batch(3, 9, seed=0, dtype=torch.bfloat16)
    adv, _ = compute_gae(**batch, gamma=0.99, gae_lambda=0.95)
    assert adv.dtype == torch.bfloat16


def test_forcing_the_kernel_where_it_cannot_run_says_to_use_tensor_ops() -> None:
    batch = make_batch(2, 5, seed=0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="use backend='torch'"):
        compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="native")


def test_an_unknown_backend_is_rejected_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'native'\)"):
        compute_gae(**make_batch(2, 5, seed=0), gamma=0.99, gae_lambda=0.95, backend="cuda")


@needs_kernel
def test_builds_no_graph_from_inputs_that_require_grad() -> None:
    batch = make_batch(4, 25, seed=9, dtype=torch.float32)
    batch["values"].requires_grad_(True)
    adv, ret = compute_gae(**batch, gamma=0.99, gae_lambda=0.95, backend="native")
    assert not adv.requires_grad and not ret.requires_grad
