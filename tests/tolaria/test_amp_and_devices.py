"""Mixed precision and envs spread over several devices in one process."""

from __future__ import annotations

import copy

import pytest
import torch

from esper.host_reads import HostReadCounter
from esper.kasmina import CNNHost, GrowingHost
from esper.mdp.env_config import EnvConfig
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import HostTraining
from tests.tolaria.loaders import image_loaders


def _envs(n: int = 2) -> list[GrowingHost]:
    torch.manual_seed(0)
    return [GrowingHost(CNNHost(channels=(8, 16))) for _ in range(n)]


def test_bf16_autocast_trains_without_host_reads_and_changes_the_numbers() -> None:
    full, mixed = _envs(), _envs()
    train, val = image_loaders()
    expected = run_epoch(full, train, val)
    with HostReadCounter() as counter:
        result = run_epoch(mixed, train, val, HostTraining(amp="bf16"))
    assert counter.count == 0, counter.report()
    assert torch.isfinite(result.train_loss).all()
    assert not torch.equal(result.train_loss, expected.train_loss)  # autocast was on
    torch.testing.assert_close(result.train_loss, expected.train_loss, rtol=0.1, atol=0.1)


def test_fp16_keeps_one_grad_scaler_per_device_across_epochs() -> None:
    envs = _envs()
    scalers: dict[torch.device, torch.amp.GradScaler] = {}
    train, val = image_loaders()
    run_epoch(envs, train, val, HostTraining(amp="fp16"), scalers=scalers)
    assert list(scalers) == [torch.device("cpu")]
    scaler = scalers[torch.device("cpu")]
    run_epoch(envs, train, val, HostTraining(amp="fp16"), scalers=scalers)
    assert scalers[torch.device("cpu")] is scaler
    assert all(torch.isfinite(p).all() for env in envs for p in env.model.parameters())


def test_unknown_amp_setting_is_refused() -> None:
    with pytest.raises(ValueError, match=r"HostTraining\.amp: must be one of"):
        HostTraining(amp="fp8")
    with pytest.raises(ValueError, match=r"EnvConfig\.amp"):
        EnvConfig(amp="int8")


def test_hosts_are_placed_round_robin_over_the_listed_devices() -> None:
    from tests.mdp.envs import small_env

    env = small_env(3, devices=("cpu", "meta"))
    assert [d.type for d in env.host_devices] == ["cpu", "meta", "cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_envs_on_two_devices_match_envs_on_one() -> None:
    one = _envs(4)
    split = copy.deepcopy(one)
    for env in split[0::2]:
        env.model.cuda()  # envs 0 and 2 on the GPU, 1 and 3 on the CPU
    train, val = image_loaders()
    expected = run_epoch(one, train, val)
    with HostReadCounter() as counter:
        # Gathered on the GPU: the CPU envs' figures are uploads, not reads.
        result = run_epoch(split, train, val, result_device="cuda")
    assert counter.count == 0, counter.report()
    torch.testing.assert_close(result.train_loss.cpu(), expected.train_loss, rtol=1e-3, atol=1e-3)
