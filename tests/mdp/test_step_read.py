"""The step's one packed read (mdp/step_read.py): every part comes back where it went in,
with exactly one device-to-host read."""

from __future__ import annotations

import numpy as np
import torch

from esper.host_reads import HostReadCounter
from esper.mdp.step_read import StepRead
from esper.tamiyo.policy import ActResult

E, M = 3, 5


def _act() -> ActResult:
    actions = torch.tensor([[0, 1, 2, 0], [3, 0, 1, 1], [2, 1, 0, 0]])
    hidden = (torch.zeros(1, E, 2), torch.zeros(1, E, 2))
    return ActResult(actions, torch.tensor([-0.5, -1.25, -2.0]), torch.zeros(E),
                     torch.tensor([0.1, 0.2, 0.3]), hidden)  # fmt: skip


def test_a_decision_read_unpacks_every_part_in_one_read() -> None:
    act = _act()
    metrics = torch.arange(E * M, dtype=torch.float32).reshape(E, M)
    panic = torch.tensor([0.0, 2.0, 1.0])
    with HostReadCounter() as counter:
        read = StepRead.of_decision(act, metrics, panic)
    assert counter.count == 1, counter.report()
    assert read.actions.dtype == np.int64
    np.testing.assert_array_equal(read.actions, act.actions.numpy())
    np.testing.assert_allclose(read.log_probs, act.log_prob.numpy())
    np.testing.assert_allclose(read.values, act.value.numpy())
    np.testing.assert_array_equal(read.metrics, metrics.numpy())
    assert read.panic is not None
    np.testing.assert_array_equal(read.panic, panic.numpy())


def test_without_a_governor_there_is_no_panic_column() -> None:
    metrics = torch.ones(E, M)
    read = StepRead.of_decision(_act(), metrics, None)
    assert read.panic is None and read.metrics.shape == (E, M)


def test_the_last_read_carries_the_bootstrap_in_place_of_the_action() -> None:
    metrics = torch.full((E, M), 0.5)
    bootstrap = torch.tensor([1.5, -2.0, 0.25])
    with HostReadCounter() as counter:
        last = StepRead.of_last(bootstrap, metrics, torch.zeros(E))
    assert counter.count == 1, counter.report()
    assert last.actions.shape == (E, 0) and last.log_probs.shape == (0,)
    np.testing.assert_allclose(last.values, bootstrap.numpy())
    np.testing.assert_array_equal(last.metrics, metrics.numpy())
    assert last.panic is not None and not last.panic.any()
