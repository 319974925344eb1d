"""Random-stream states survive a safe checkpoint round trip and restore exactly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from esper.simic.rng import capture_rng_state, restore_rng_state


def _draws() -> tuple[float, float, float, float]:
    return (
        random.random(),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(1).item(),
    )


def test_captured_state_loads_with_weights_only_and_replays_every_stream(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state: it must survive too
    path = tmp_path / "rng.pt"
    torch.save(capture_rng_state(), path)
    expected = _draws()

    _draws()  # move every stream on
    restore_rng_state(torch.load(path, weights_only=True))

    assert _draws() == expected
