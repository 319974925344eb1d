"""Capture and restore every random stream a run draws from, for exact resume.

The captured state holds only tensors, plain containers and numbers, so a checkpoint that
carries it loads with ``torch.load(..., weights_only=True)``: numpy's state arrives as an
``ndarray`` and Python's as a nested tuple, and both are rewritten here into forms the
safe unpickler accepts (a tensor, a list) and back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "name": str(name),
        # MT19937's key is uint32; int64 holds every value exactly and torch has no uint32 ops.
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"])
    )


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "internal": list(internal), "gauss_next": gauss_next}


def _set_python_state(state: dict[str, Any]) -> None:
    random.setstate((state["version"], tuple(state["internal"]), state["gauss_next"]))


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (where present) every CUDA device's generator state."""
    state: dict[str, Any] = {
        "python": _python_state(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo :func:`capture_rng_state`; CUDA states are restored only where CUDA exists."""
    _set_python_state(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
