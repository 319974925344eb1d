"""HostTraining: how a host epoch trains, checked once and handed whole to run_epoch."""

from __future__ import annotations

import pytest
import torch

from esper.contracts.config_errors import ConfigError
from esper.mdp.env_config import EnvConfig
from esper.mdp.pairing import Pairing
from esper.tolaria.host_training import HostTraining


def test_an_env_config_hands_its_groups_training_settings_whole() -> None:
    config = EnvConfig(
        n_envs=6,
        on_oom="skip_env_epoch",
        amp="bf16",
        cpu_workers=2,
        pairing=Pairing(True, pair_size=3),
    )
    assert config.host_training == HostTraining(
        on_oom="skip_env_epoch", compile=False, amp="bf16", paired_group=3, cpu_workers=2
    )
    assert EnvConfig(n_envs=6).host_training.paired_group is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("on_oom", "ignore", r"HostTraining\.on_oom: must be one of \['raise', 'skip_env_epoch'\]"),
        ("compile", 1, r"HostTraining\.compile: must be true or false"),
        ("amp", "fp8", r"HostTraining\.amp: must be one of \['off', 'bf16', 'fp16'\]"),
        ("paired_group", 0, r"HostTraining\.paired_group: must be an int >= 1"),
        ("cpu_workers", 0, r"HostTraining\.cpu_workers: must be an int >= 1.*null for every core"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HostTraining(**{field: value})  # type: ignore[arg-type]


def test_the_env_config_names_its_own_field_for_the_same_checks() -> None:
    with pytest.raises(ConfigError, match=r"EnvConfig\.cpu_workers"):
        EnvConfig(cpu_workers=0)


CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("settings", "devices", "stacks"),
    [
        ({}, [GPU, GPU], True),  # auto: stacked where every host is on a GPU
        ({}, [CPU, CPU], False),  # per_env's worker threads win on a CPU
        ({}, [GPU, CPU], False),
        ({}, [], False),  # no hosts: nothing to stack
        ({"amp": "fp16"}, [GPU], False),  # per-env GradScalers: per_env
        ({"compile": True}, [GPU], False),
        ({"amp": "bf16"}, [GPU], True),
        ({"engine": "per_env"}, [GPU], False),
        ({"engine": "stacked"}, [CPU], True),
    ],
)
def test_the_engine_is_stacked_on_gpus_unless_set(
    settings: dict[str, object], devices: list[torch.device], stacks: bool
) -> None:
    training = HostTraining(**settings)  # type: ignore[arg-type]
    assert training.stacks(devices) is stacks
    assert EnvConfig(**settings).host_training.stacks(devices) is stacks  # type: ignore[arg-type]
