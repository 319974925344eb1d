"""Lightning's DDP (gloo, 2 ranks on CPU): identical policies, distinct env groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.simic.ddp_run import N_RANKS, UPDATES

SCRIPT = Path(__file__).with_name("ddp_run.py")
TIMEOUT_S = 300


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_two_gloo_ranks_hold_identical_policies_after_every_update(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for update in range(UPDATES):
        ranks = [torch.load(tmp_path / f"rank{r}_update{update}.pt") for r in range(N_RANKS)]
        a, b = ranks
        for name, value in a["policy"].items():
            assert torch.equal(value, b["policy"][name]), f"update {update}: {name} differs"
        for name, value in a["normalizer"].items():
            assert torch.allclose(value, b["normalizer"][name]), f"normaliser {name} differs"
        # Each rank ran its own share of the envs, with its own seeds and data order.
        assert a["n_envs"] == b["n_envs"] == 2
        assert a["returns"] != b["returns"]
    # The policy moved: gradients were applied (and, being equal, were averaged alike).
    first = torch.load(tmp_path / "rank0_update0.pt")["policy"]
    last = torch.load(tmp_path / f"rank0_update{UPDATES - 1}.pt")["policy"]
    assert any(not torch.equal(first[k], last[k]) for k in first)
