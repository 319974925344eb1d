"""The host-read counter must see every kind of read the hot-path rule forbids."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from esper.host_reads import HostReadCounter

READS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "bool": lambda t: bool(t.sum() > 0),
    "if_tensor": lambda t: 1 if t.sum() > 0 else 0,
    "float": lambda t: float(t.sum()),
    "int": lambda t: int(t.sum()),
    "index": lambda t: [0, 1, 2][t.long()[0]],
    "nonzero": lambda t: t.nonzero(),
    "bool_mask_index": lambda t: t[t > 0],
    "bool_mask_assign": lambda t: t.clone().__setitem__(t > 0, 0.0),
    "masked_select": lambda t: torch.masked_select(t, t > 0),
    "unique": lambda t: torch.unique(t),
    "equal": lambda t: torch.equal(t, t),
    "allclose": lambda t: torch.allclose(t, t),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_each_forbidden_read_is_counted_once(name: str) -> None:
    t = torch.arange(4.0)
    with HostReadCounter() as counter:
        READS[name](t)
    assert counter.count == 1, counter.report()


def test_device_side_work_is_not_a_read() -> None:
    t = torch.randn(8, 3, requires_grad=True)
    acc = torch.zeros(())
    flags = torch.ones(3, dtype=torch.bool)
    with HostReadCounter() as counter:
        loss = (t * 2).relu().sum()
        loss.backward()
        acc.add_(loss.detach())
        flags.logical_and_(torch.isfinite(t.grad).all(dim=0))
        torch.where(t > 0, t, 0.0).argmax(dim=1)
        t[:, 1:2].detach().clone()
    assert counter.count == 0, counter.report()


def test_data_loader_bookkeeping_is_ignored_by_default_but_countable() -> None:
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, shuffle=True)
    with HostReadCounter() as counter:
        list(loader)
    assert counter.count == 0, counter.report()
    with HostReadCounter(ignore_paths=()) as strict:
        list(loader)
    assert strict.count > 0


def test_report_names_the_calling_line() -> None:
    with HostReadCounter() as counter:
        torch.ones(2).sum().item()
    assert "test_report_names_the_calling_line" in counter.report()


def test_tensor_methods_are_restored_on_exit_even_after_an_error() -> None:
    original = torch.Tensor.item
    with pytest.raises(ZeroDivisionError), HostReadCounter():
        _ = 1 / 0
    assert torch.Tensor.item is original


@pytest.mark.parametrize("name", sorted(READS))
def test_nested_counters_each_count_every_read_made_while_they_are_active(name: str) -> None:
    t = torch.arange(4.0)
    with HostReadCounter() as outer:
        READS[name](t)
        with HostReadCounter() as inner:
            READS[name](t)
        READS[name](t)
    assert inner.count == 1, inner.report()
    assert outer.count == 3, outer.report()


def test_exiting_an_outer_counter_first_ends_the_inner_ones_and_leaks_nothing() -> None:
    original = torch.Tensor.item
    modes = torch._C._len_torch_dispatch_stack()
    outer, inner = HostReadCounter(), HostReadCounter()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)  # already ended: a no-op
    assert torch.Tensor.item is original
    assert torch._C._len_torch_dispatch_stack() == modes
    torch.ones(()).item()
    assert outer.count == inner.count == 0


def test_a_counter_cannot_be_entered_twice_at_once() -> None:
    counter = HostReadCounter()
    with counter, pytest.raises(RuntimeError, match="already active"):
        counter.__enter__()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_to_host_copies_are_counted_and_uploads_are_not() -> None:
    t = torch.arange(4.0, device="cuda")
    with HostReadCounter() as counter:
        t.to("cpu")
        torch.empty(4).copy_(t)
        torch.ones(4).to("cuda", non_blocking=True)
        t.tolist()
    assert counter.count == 3, counter.report()


@pytest.mark.parametrize("name", sorted(READS))
def test_each_read_in_a_host_worker_thread_is_counted_once(name: str) -> None:
    from esper.tolaria.parallel import run_env_steps

    t = torch.arange(4.0)

    def step(env: int, b: int, item: object) -> None:
        READS[name](t)

    with HostReadCounter() as counter:
        run_env_steps(2, 2, [0], lambda: None, step, lambda env, tail: env)
    assert counter.count == 2, counter.report()  # one read per env's step, both workers


def test_a_plain_thread_is_not_seen_by_the_dispatch_layer_without_joining() -> None:
    # The negative control: dispatch modes are per thread, so the worker threads' reads
    # above are counted only because the workers extend the counter to themselves.
    import threading

    from esper.host_reads import counting_in_this_thread

    t = torch.arange(4.0)

    def mask_read() -> None:
        t[t > 1]  # a boolean-mask index: an aten read the method wrappers never see

    def joined() -> None:
        with counting_in_this_thread():
            mask_read()

    with HostReadCounter() as counter:
        for target in (mask_read, joined):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
    assert counter.count == 1, counter.report()  # the joined thread's read only


def test_counting_in_a_thread_with_no_counter_active_does_nothing() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from esper.host_reads import counting_in_this_thread

    with counting_in_this_thread():
        assert _get_current_dispatch_mode() is None  # no counter: no mode in the way
