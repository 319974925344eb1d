"""benchmarks/workers.py times the pure host compute itself in threads and in processes."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from esper.tolaria.data import DATAMODULES
from tests.benchmarks.loading import load_benchmark
from tests.benchmarks.test_rollout_overhead import _hosts, tiny_fit


def _load():  # type: ignore[no-untyped-def]
    return load_benchmark("workers")


def _work():  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    train = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,))) for _ in range(3)]
    val = [(torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 4, (6,)))]
    return train, val


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_threads_and_processes_train_what_the_sequential_pure_compute_trains() -> None:
    """Same hosts, batches and shares: every split ends bit-identical to one after another."""
    bench = _load()
    train, val = _work()
    epochs = [_hosts(4), _hosts(4)]
    sequential, in_threads = copy.deepcopy(epochs), copy.deepcopy(epochs)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.pure_host_compute(sequential, train, val, 1, 2)
    finally:
        torch.set_num_threads(previous)

    bench.threads_fixed_split(in_threads, train, val, 2, workers=2)
    _, states = bench.processes_fixed_split(epochs, train, val, 2, 2, send_hosts=True)

    for e, hosts in enumerate(sequential):
        for i, host in enumerate(hosts):
            _same(host.model.state_dict(), in_threads[e][i].model.state_dict())
            _same(host.model.state_dict(), states[e][i])


def test_envs_split_round_robin_over_the_workers() -> None:
    assert _load()._split(5, 2) == [[0, 2, 4], [1, 3]]


def test_the_recorder_keeps_each_timed_epoch_s_hosts_in_a_real_fit(tmp_path: Path) -> None:
    """One copy of the hosts per host epoch of the timed updates (3 per 3-epoch episode),
    beside the wall figures of the timer it extends."""
    bench = _load()
    data = DATAMODULES.get("synthetic")(
        input_shape=[3, 8, 8], n_classes=4, n_train=64, n_val=32, batch_size=16
    )
    recorder = bench._Recorder(1, data, 1, None)
    tiny_fit(recorder, tmp_path)

    assert len(recorder.epochs) == 2 * 3  # 2 timed updates after 1 warm-up
    assert all(len(hosts) == 4 for hosts in recorder.epochs)
    assert len(recorder.seconds) == len(recorder.host_epochs) == 2
