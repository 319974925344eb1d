"""One real tiny rollout, shared by the picture tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from esper.contracts.rollout import StepBatch
from tests.mdp.envs import collector, small_env


@pytest.fixture(scope="session")
def rollout() -> Iterator[tuple[list[StepBatch], tuple[str, ...]]]:
    """The step batches of one real tiny rollout (2 envs, 5 host epochs) and the slot names."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors; a second spinning thread only costs here
    try:
        env = small_env(2, 5)
        col = collector(env)
        steps: list[StepBatch] = []
        col.collect_batch(0, on_step=steps.append)
    finally:
        torch.set_num_threads(previous)
    yield steps, tuple(env.slot_ids)
