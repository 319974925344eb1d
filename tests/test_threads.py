"""An intra-op thread count of the block's own: set for the block, then given back."""

from __future__ import annotations

import pytest
import torch

from esper.threads import intra_op_threads


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_the_block_runs_at_the_count_asked_and_the_count_comes_back(two_threads: None) -> None:
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_none_leaves_the_count_as_it_is(two_threads: None) -> None:
    with intra_op_threads(None):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_the_count_comes_back_when_the_block_raises(two_threads: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), intra_op_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
