"""Run tests on one intra-op thread: their tensors are tiny, and on a shared 2-core machine
a second spinning OpenMP thread costs more than it saves. Restored after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
