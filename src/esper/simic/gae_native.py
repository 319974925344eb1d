"""GAE for CPU tensors through the C kernel built with the package, when it was built.

``pip install`` compiles ``_gae_kernel.c`` (a C compiler and Python's headers are all it
needs; no torch headers). The build is optional: where it fails, the package still
installs and ``compute_gae`` solves with tensor ops instead, which gives the same numbers
at about a third of the speed on large rollouts. ``available()`` says which case holds.

The kernel reads raw addresses, so everything it trusts is checked here: CPU, contiguous,
the float dtypes it was compiled for, bool flags of the same shape. Nothing here reads a
tensor's values on the host; on a CPU there is no device to synchronise with.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

#: Floating dtypes the kernel has a loop for; others (float16, bfloat16) use tensor ops.
NATIVE_DTYPES = (torch.float32, torch.float64)

try:
    _kernel = importlib.import_module("esper.simic._gae_kernel")
except ImportError:  # not built: no compiler at install time, or running from a bare checkout
    _kernel = None


def available() -> bool:
    """Whether the C kernel was built and imported."""
    return _kernel is not None


def supports(tensor: Tensor) -> bool:
    """Whether GAE on inputs like ``tensor`` (device, dtype) can run in the kernel."""
    return _kernel is not None and tensor.device.type == "cpu" and tensor.dtype in NATIVE_DTYPES


def gae_native(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """``compute_gae``'s contract in one backward pass per env row, on the CPU.

    Inputs must already have passed ``compute_gae``'s checks (shapes, dtypes, devices,
    rates) and be detached; non-contiguous ones are copied to contiguous first.

    Raises:
        RuntimeError: the kernel was not built, or the inputs are not CPU tensors of a
            dtype in ``NATIVE_DTYPES``: call ``compute_gae(..., backend="torch")``.
    """
    if not supports(rewards):
        why = (
            "the C kernel esper.simic._gae_kernel was not built (reinstall with a C compiler)"
            if _kernel is None
            else f"it takes CPU tensors of dtype {NATIVE_DTYPES}, got {rewards.dtype} on {rewards.device}"
        )
        raise RuntimeError(f"gae_native: {why}; use backend='torch'")
    floats = [x.contiguous() for x in (rewards, values, next_values)]
    flags = [x.contiguous() for x in (terminated, done)]
    n_envs, n_steps = rewards.shape
    advantages = rewards.new_empty(n_envs, n_steps)
    returns = rewards.new_empty(n_envs, n_steps)
    _kernel.solve(
        *(x.data_ptr() for x in (*floats, *flags, advantages, returns)),
        n_envs,
        n_steps,
        float(gamma),
        float(gae_lambda),
        rewards.dtype == torch.float64,
    )
    return advantages, returns
