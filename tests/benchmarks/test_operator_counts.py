"""``benchmarks/operator_counts.py``: operators per update, Esper and esper-lite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from esper.tolaria import epoch as epoch_module
from tests.benchmarks.loading import load_benchmark

operator_counts = load_benchmark("operator_counts")

#: Small enough for the suite: few images, two-epoch episodes.
SMALL = ["--data.n_train", "32", "--data.n_val", "16", "--model.episode_epochs", "2"]


def test_a_longer_esper_fit_issues_more_operators() -> None:
    one, two = (operator_counts.esper_operators(2, n, "stacked", SMALL) for n in (1, 2))
    assert 0 < one < two


def test_per_env_training_is_counted_whole_in_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On two threads the per-env engine trains in worker threads, out of a dispatch
    mode's sight; the count runs on one, so every host step is in the counted thread."""
    threads: list[threading.Thread] = []
    real = epoch_module._train_step

    def recorded(*args: Any, **kwargs: Any) -> None:
        threads.append(threading.current_thread())
        real(*args, **kwargs)

    monkeypatch.setattr(epoch_module, "_train_step", recorded)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        operator_counts.esper_operators(2, 1, "per_env", SMALL)
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(before)
    assert threads and set(threads) == {threading.main_thread()}


def _fake_peer(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "run_peer.py"
    script.write_text(textwrap.dedent(body))
    return script


def test_the_peer_counter_counts_kernels_in_the_launched_script(tmp_path: Path) -> None:
    script = _fake_peer(
        tmp_path,
        """
        import sys
        import torch
        assert sys.argv[1:3] == ["ppo", "--task"], sys.argv  # the launcher's arguments
        x = torch.ones(3)  # one fill
        (x + 1).view(3, 1).sum()  # add and sum; the view launches nothing
        torch.empty(2)  # a bare allocation launches nothing
        import copy
        copy.deepcopy(torch.zeros(0))  # empty: its set_ and copy launch nothing
        sys.exit(0)
        """,
    )
    venv = Path(sys.executable).parents[1]
    assert operator_counts.peer_operators(2, 1, venv, script) == 3


def test_a_failing_peer_run_raises_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="FileNotFoundError: no data")
    monkeypatch.setattr(operator_counts.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match=r"exit 1\): FileNotFoundError: no data"):
        operator_counts.peer_operators(2, 1, Path(sys.executable).parents[1])


def test_a_missing_peer_environment_says_how_to_build_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["operator_counts.py", "--peer-venv", str(tmp_path / "none")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        operator_counts.main()
    assert "side_by_side.sh once" in capsys.readouterr().err
