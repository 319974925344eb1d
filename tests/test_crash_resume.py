"""A run killed with SIGKILL resumes from its last checkpoint, in its own run folder, and
ends where an unbroken run does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from esper.callbacks.checkpoint import find_last_checkpoint
from tests.test_cli import TINY_CONFIG

MAX_EPOCHS = 4
#: Generous: the tiny run takes about a second per update on 2 CPU cores.
WAIT_S = 120


def _fit(config: Path, root: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "esper.cli",
            "fit",
            "--config",
            str(config),
            "--trainer.max_epochs",
            str(MAX_EPOCHS),
            "--trainer.default_root_dir",
            str(root),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_a_run_killed_with_sigkill_resumes_to_the_weights_of_an_unbroken_run(
    tmp_path: Path,
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    root = tmp_path / "run"
    last = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"

    first = _fit(config, root)
    deadline = time.monotonic() + WAIT_S
    while not last.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert last.exists(), f"no checkpoint before the kill:\n{first.communicate()[0]}"
    # Into the next update, so that the events file holds records the checkpoint does not:
    # kill once the second rollout's records are written (a rollout's end flushes them),
    # not after a fixed wait, which a quick machine spent finishing the whole run.
    events = last.parent.parent / "events.jsonl"
    while not _has_rollout(events, 1) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.poll() is None, "the run finished before it could be killed; lengthen it"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL

    resumed = _fit(config, root, "--ckpt_path", "last")
    out, _ = resumed.communicate(timeout=WAIT_S)
    assert resumed.returncode == 0, out
    assert "Restoring states from the checkpoint" in out
    assert f"esper fit: {MAX_EPOCHS} PPO update(s)" in out
    # One run folder, continued: one events file in which each rollout appears once.
    assert [p.name for p in (root / "lightning_logs").iterdir()] == ["version_0"]
    records = [json.loads(line) for line in (last.parent.parent / "events.jsonl").open()]
    updates = [r["rollout"] for r in records if r["kind"] == "ppo_update"]
    assert updates == list(range(MAX_EPOCHS)), updates
    (resume,) = [r for r in records if r["kind"] == "resume"]
    assert resume["dropped_unfinished"] >= 0

    # Finishing is not enough: the resumed run must end exactly where one never killed does.
    unbroken_root = tmp_path / "unbroken"
    unbroken = _fit(config, unbroken_root)
    unbroken_out, _ = unbroken.communicate(timeout=WAIT_S)
    assert unbroken.returncode == 0, unbroken_out
    want = _final_state_dict(unbroken_root)
    got = _final_state_dict(root)
    assert got.keys() == want.keys()
    differ = [key for key in want if not torch.equal(got[key], want[key])]
    assert not differ, f"the resumed run's final weights differ from the unbroken run's: {differ}"


def _has_rollout(events: Path, rollout: int) -> bool:
    """Whether ``events`` holds a whole record of ``rollout`` or a later one."""
    if not events.exists():
        return False
    lines = events.read_text(encoding="utf-8").splitlines(keepends=True)
    whole = [line for line in lines if line.endswith("\n")]  # a line being written is not
    return any(json.loads(line).get("rollout", -1) >= rollout for line in whole)


def _final_state_dict(root: Path) -> dict[str, torch.Tensor]:
    """The module weights in a run's final checkpoint."""
    last = find_last_checkpoint(root)
    assert last is not None, f"no last.ckpt under {root}"
    checkpoint = torch.load(last, weights_only=True)
    return checkpoint["state_dict"]
