"""Run tests on one intra-op thread: their tensors are tiny, and on a shared 2-core machine
a second spinning OpenMP thread costs more than it saves. Restored after each test.

``taped``: the CPU records steps on the tests' tape (``tests/tolaria/op_tape.py``), for
the tests of what records CUDA graphs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from esper.tolaria import step_graph
from tests.tolaria.op_tape import TapeRecorder


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def taped(monkeypatch: pytest.MonkeyPatch) -> list[TapeRecorder]:
    """The CPU records on the tape, one recorder for the CPU (as for each GPU), not yet
    warmed up; the recorders made."""
    made: list[TapeRecorder] = []

    def make(device: torch.device) -> TapeRecorder:
        made.append(TapeRecorder(device))
        return made[-1]

    monkeypatch.setitem(step_graph.RECORDERS, "cpu", make)
    monkeypatch.setattr(step_graph, "_made", {})
    return made
