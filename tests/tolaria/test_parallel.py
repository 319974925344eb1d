"""CPU worker threads: envs train at once, with results equal to the sequential path's.

The sequential path is run at one intra-op thread, the count every worker runs its ops at:
a float sum split over two intra-op threads may round differently, and equality is only
promised at the same per-op thread count.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from esper.contracts import BlendMode, SeedStage
from esper.contracts.config_errors import ConfigError
from esper.host_reads import HostReadCounter
from esper.kasmina import GrowingHost, TransformerHost
from esper.mdp.env_config import EnvConfig
from esper.tolaria import epoch
from esper.tolaria.epoch import EpochResult, run_epoch
from esper.tolaria.host_training import HostTraining
from esper.tolaria.parallel import resolve_workers, run_env_steps, threads_per_worker
from tests.mdp.envs import collector, small_env
from tests.tolaria.grown import Grown, float64_default, grown_envs
from tests.tolaria.loaders import image_loaders, token_loaders
from tests.tolaria.test_epoch import FAST, cnn_envs, to_stage


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def assert_same_result(a: EpochResult, b: EpochResult) -> None:
    for name, value in a.as_dict().items():
        assert torch.equal(value, b.as_dict()[name]), name
    assert a.skipped_envs == b.skipped_envs


def assert_same_hosts(a: list[GrowingHost], b: list[GrowingHost]) -> None:
    for env_a, env_b in zip(a, b, strict=True):
        for (name, p), q in zip(
            env_a.model.state_dict().items(), env_b.model.state_dict().values(), strict=True
        ):
            assert torch.equal(p, q), name
        state_a, state_b = env_a.host_optimizer.state_dict(), env_b.host_optimizer.state_dict()
        for key, per_param in state_a["state"].items():
            for field, value in per_param.items():
                if isinstance(value, Tensor):
                    assert torch.equal(value, state_b["state"][key][field]), (key, field)


def transformer_envs() -> list[GrowingHost]:
    torch.manual_seed(0)
    envs = [GrowingHost(TransformerHost(seq_len=12, d_model=32, lifecycle=FAST)) for _ in range(3)]
    envs[0].germinate("block0", "attention", BlendMode.LINEAR)
    to_stage(envs[0], "block0", SeedStage.BLENDING)
    envs[1].germinate("block1", "lora", BlendMode.LINEAR)
    to_stage(envs[1], "block1", SeedStage.TRAINING)
    return envs


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_cnn_envs_in_workers_equal_the_sequential_path_bit_for_bit(workers: int) -> None:
    """Seeds in every stage run_epoch treats differently; 3 workers give uneven groups."""
    sequential, parallel = cnn_envs(), cnn_envs()
    train, val = image_loaders()
    for _ in range(3):
        expected = run_epoch(sequential, train, val, HostTraining(cpu_workers=1))
        got = run_epoch(parallel, train, val, HostTraining(cpu_workers=workers))
        assert_same_result(expected, got)
    assert_same_hosts(sequential, parallel)
    assert torch.get_num_threads() == 1  # restored, not left at the workers' count


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans().flatmap(lambda transformer: grown_envs(transformer)), st.integers(2, 3))
def test_envs_grown_at_random_in_workers_equal_the_sequential_path_bit_for_bit(
    case: Grown, workers: int
) -> None:
    """Any mix of seeds, stages, ramps and merged widenings, CNN or transformer hosts,
    even or uneven batches, paired or not (``tests.tolaria.test_stacked.grown_envs``)."""
    train, val = case.loaders()
    with float64_default():
        sequential, parallel = case.envs(), case.envs()
        for _ in range(2):
            expected = run_epoch(
                sequential, train, val, HostTraining(cpu_workers=1, **case.training())
            )
            got = run_epoch(
                parallel, train, val, HostTraining(cpu_workers=workers, **case.training())
            )
            assert_same_result(expected, got)
        assert_same_hosts(sequential, parallel)


def test_with_spare_cores_each_worker_runs_on_its_share_and_equals_that_many_threads() -> None:
    # 4 cores for 2 envs: each worker's ops run on 2 intra-op threads, and the results are
    # the sequential path's on 2 threads, bit for bit.
    assert threads_per_worker(2) == 1  # the suite runs on one thread: no spare cores
    sequential, parallel = cnn_envs(), cnn_envs()
    train, val = image_loaders()
    seen: list[int] = []
    step = epoch._train_env_on_batch

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    try:
        torch.set_num_threads(4)
        assert threads_per_worker(2) == 2 and threads_per_worker(3) == 1
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(epoch, "_train_env_on_batch", counting)
            got = run_epoch(parallel, train, val, HostTraining(cpu_workers=2))
        assert set(seen) == {2}, seen
        torch.set_num_threads(2)
        expected = run_epoch(sequential, train, val, HostTraining(cpu_workers=1))
    finally:
        torch.set_num_threads(1)
    assert_same_result(expected, got)
    assert_same_hosts(sequential, parallel)


def test_transformer_envs_in_workers_equal_the_sequential_path_with_paired_shares() -> None:
    sequential, parallel = transformer_envs(), transformer_envs()
    train, val = token_loaders()
    for _ in range(2):
        expected = run_epoch(sequential, train, val, HostTraining(cpu_workers=1, paired_group=3))
        got = run_epoch(parallel, train, val, HostTraining(cpu_workers=2, paired_group=3))
        assert_same_result(expected, got)
    assert_same_hosts(sequential, parallel)


def test_workers_read_nothing_on_the_host() -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    with HostReadCounter() as counter:
        run_epoch(envs, train, val, HostTraining(cpu_workers=2))
    assert counter.count == 0, counter.report()


def test_a_rollout_with_workers_equals_the_sequential_rollout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real envs, policy and rewards: two episodes give the same transitions and hosts."""
    parallel_epochs: list[int] = []

    def counted(n_envs: int, workers: int, *args: object) -> list[object]:
        parallel_epochs.append(workers)
        return run_env_steps(n_envs, workers, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(epoch, "run_env_steps", counted)
    runs = []
    for workers in (1, 2):
        col = collector(small_env(4, 3, cpu_workers=workers))
        steps: list[object] = []
        batches = [col.collect_batch(r, on_step=steps.append)[0] for r in range(2)]
        runs.append((col, steps, batches))
    (col_a, steps_a, batches_a), (col_b, steps_b, batches_b) = runs
    assert parallel_epochs == [2] * 6  # every host epoch of the second run, in 2 threads
    assert len(steps_a) == len(steps_b) == 4
    for a, b in zip(steps_a, steps_b, strict=True):
        np.testing.assert_array_equal(a.rewards, b.rewards)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(a.actions, b.actions)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(a.val_acc, b.val_acc)  # type: ignore[attr-defined]
    for a, b in zip(batches_a, batches_b, strict=True):
        assert torch.equal(a.advantages, b.advantages)
    assert_same_hosts(col_a.env.hosts, col_b.env.hosts)


def test_a_worker_error_is_raised_after_every_worker_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    bad = [(torch.randn(16, 3, 8, 8), torch.zeros(16, dtype=torch.long))]  # wrong channels
    workers: set[threading.Thread] = set()
    step = epoch._train_env_on_batch

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        workers.add(threading.current_thread())
        return step(*args, **kwargs)

    monkeypatch.setattr(epoch, "_train_env_on_batch", recording)
    with pytest.raises(ValueError, match=r"CNNHost expects images shaped \[batch, 1, 8, 8\]"):
        run_epoch(envs, bad, val, HostTraining(cpu_workers=2))
    assert workers and not any(t.is_alive() for t in workers)
    assert threading.main_thread() not in workers  # it was the workers that failed
    assert torch.get_num_threads() == 1
    run_epoch(envs, train, val, HostTraining(cpu_workers=2))  # the envs still train afterwards


def _count_steps(
    n_envs: int, workers: int, items: Iterator[object] | list[object]
) -> tuple[list[int], dict[int, list[int]]]:
    """Run ``run_env_steps`` recording each env's batch indices; returns the finish
    results (steps seen per env) and the indices."""
    seen: dict[int, list[int]] = {e: [] for e in range(n_envs)}

    def step(env: int, b: int, item: object) -> None:
        seen[env].append(b)

    def finish(env: int, tail: str) -> int:
        assert tail == "val"
        return len(seen[env])

    return run_env_steps(n_envs, workers, items, lambda: "val", step, finish), seen


def test_a_failing_loader_stops_the_workers_and_its_error_is_raised() -> None:
    train, _ = image_loaders()

    def failing() -> Iterator[tuple[Tensor, Tensor]]:
        yield next(iter(train))
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        run_env_steps(3, 2, failing(), lambda: None, lambda *_: None, lambda env, tail: env)
    assert set(threading.enumerate()) <= before  # no worker left running
    assert torch.get_num_threads() == 1
    counts, seen = _count_steps(3, 2, list(range(5)))
    assert counts == [5, 5, 5]
    assert all(order == [0, 1, 2, 3, 4] for order in seen.values())


def test_an_idle_worker_takes_any_free_env_so_a_slow_env_holds_up_no_other() -> None:
    """Env 0's first step waits until every other env has finished: with envs split into
    fixed halves, env 1 would wait behind env 0 and the epoch would never end."""
    others_done = threading.Event()
    finished: list[int] = []
    lock = threading.Lock()

    def step(env: int, b: int, item: object) -> None:
        if env == 0 and b == 0:
            assert others_done.wait(timeout=10), "a worker sat on env 1 behind env 0"

    def finish(env: int, tail: None) -> int:
        with lock:
            finished.append(env)
            if sorted(finished) == [1, 2, 3]:
                others_done.set()
        return env

    assert run_env_steps(4, 2, range(3), lambda: None, step, finish) == [0, 1, 2, 3]
    assert finished[-1] == 0


def test_a_worker_takes_the_env_with_the_most_work_left() -> None:
    """Env 0's steps are slow: once both envs have been timed, the worker keeps to env 0
    (the one that would finish last) and leaves env 1's quick steps for the end."""
    order: list[int] = []

    def step(env: int, b: int, item: object) -> None:
        order.append(env)
        if env == 0:
            time.sleep(0.02)

    assert run_env_steps(2, 1, range(6), lambda: None, step, lambda env, tail: env) == [0, 1]
    assert order[:2] == [0, 1]  # untimed: in turn
    assert order[2:] == [0] * 5 + [1] * 5


def test_an_env_whose_finish_is_known_to_be_long_trains_and_finishes_first() -> None:
    """Equal steps; env 1's finish is expected to take a second: once the steps are
    timed, the worker trains env 1 through and finishes it before env 0's steps, so that
    its long finish does not come last."""
    order: list[tuple[int, str]] = []

    def step(env: int, b: int, item: object) -> None:
        order.append((env, "step"))

    def finish(env: int, tail: object) -> int:
        order.append((env, "finish"))
        return env

    assert run_env_steps(2, 1, range(6), lambda: None, step, finish, [None, 1.0]) == [0, 1]
    assert order[:2] == [(0, "step"), (1, "step")]  # untimed: in turn
    assert order[2:] == [(1, "step")] * 5 + [(1, "finish")] + [(0, "step")] * 5 + [(0, "finish")]


def test_finish_seconds_must_name_every_env() -> None:
    with pytest.raises(ValueError, match="holds 1 entries for 2 envs; give one per env"):
        run_env_steps(2, 1, range(2), lambda: None, lambda *_: None, lambda e, t: e, [1.0])


def test_a_worker_epoch_expects_each_envs_validation_to_take_what_its_last_one_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected: list[list[float | None]] = []

    def remembering(*args: object) -> list[object]:
        expected.append(list(args[6]))  # type: ignore[call-overload]
        return run_env_steps(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(epoch, "run_env_steps", remembering)
    envs = cnn_envs()
    train, val = image_loaders()
    run_epoch(envs, train, val, HostTraining(cpu_workers=2))
    measured = [epoch._validation_seconds[env] for env in envs]
    run_epoch(envs, train, val, HostTraining(cpu_workers=2))
    assert expected[0] == [None] * len(envs)  # new hosts: nothing measured yet
    assert all(s > 0 for s in measured)
    assert expected[1] == measured


def test_batches_of_unknown_length_are_scheduled_too() -> None:
    """A loader over an iterable dataset has no length (its ``len`` raises)."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[Tensor]:
            return iter(torch.arange(5.0).split(1))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    with pytest.raises(TypeError):
        len(loader)
    counts, seen = _count_steps(3, 2, loader)
    assert counts == [5, 5, 5]
    assert all(order == [0, 1, 2, 3, 4] for order in seen.values())


def test_a_step_error_stops_every_worker_and_is_raised() -> None:
    steps: list[threading.Thread] = []

    def step(env: int, b: int, item: object) -> None:
        steps.append(threading.current_thread())
        if env == 2 and b == 1:
            raise ValueError("env 2 failed")

    with pytest.raises(ValueError, match="env 2 failed"):
        run_env_steps(4, 2, range(100), lambda: None, step, lambda env, tail: env)
    assert steps and not any(t.is_alive() for t in steps)
    assert len(steps) < 4 * 100  # the schedule stopped: the other envs did not go on
    assert torch.get_num_threads() == 1


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), as a terminal's process has it; a
    shell that starts jobs in the background (CI runners) hands them SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_while_waiting_for_the_workers_raises_only_once_every_worker_stopped() -> None:
    # The interrupt lands on the calling thread while it joins the workers (SIGINT sent to
    # that thread, as a terminal's Ctrl-C reaches it). Leaving with workers still inside
    # their step is what ended `esper fit` in SIGABRT at interpreter shutdown.
    main = threading.get_ident()
    running: set[int] = set()

    def step(env: int, b: int, item: object) -> None:
        running.add(threading.get_ident())
        if env == 0:
            time.sleep(0.2)  # the calling thread has drawn the one batch and is joining
            signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.5)

    with pytest.raises(KeyboardInterrupt):
        run_env_steps(2, 2, [0], lambda: None, step, lambda env, tail: env)
    alive = [t for t in threading.enumerate() if t.ident in running and t.is_alive()]
    assert len(running) == 2 and alive == [], alive
    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_while_the_workers_start_raises_only_once_every_worker_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C right after the first worker starts, before the second: a started worker
    # must not be left running (it trained on past the interpreter's shutdown: SIGABRT).
    main = threading.get_ident()
    start = threading.Thread.start
    started: list[threading.Thread] = []

    def start_then_interrupt(self: threading.Thread) -> None:
        start(self)
        started.append(self)
        signal.pthread_kill(main, signal.SIGINT)

    def step(env: int, b: int, item: object) -> None:
        time.sleep(0.3)

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_env_steps(2, 2, [0, 1], lambda: None, step, lambda env, tail: env)
    monkeypatch.undo()
    assert started and [t for t in started if t.is_alive()] == []


def test_workers_default_to_torch_threads_at_most_one_per_env() -> None:
    torch.set_num_threads(2)
    assert resolve_workers(None, 4) == 2
    assert resolve_workers(None, 1) == 1
    torch.set_num_threads(1)
    assert resolve_workers(None, 4) == 1
    assert resolve_workers(8, 4) == 4


def test_cpu_workers_must_be_a_positive_int_or_null() -> None:
    assert EnvConfig(cpu_workers=2).cpu_workers == 2
    with pytest.raises(ConfigError, match="cpu_workers"):
        EnvConfig(cpu_workers=0)
