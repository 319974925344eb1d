"""How a host epoch trains: the settings ``run_epoch`` takes whole, checked once here.

``EnvConfig`` (the user's fields, named in config errors) hands its env group's share of
them to every host epoch as one :class:`HostTraining`; ``run_epoch`` trusts it and only
checks what depends on the envs it is given (a paired group must divide them).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from esper.contracts.config_errors import (
    ConfigError,
    owned_by,
    require_bool,
    require_choice,
    require_int,
)

#: Autocast dtypes by the ``amp`` setting (None: full precision).
AMP_DTYPES: dict[str, torch.dtype | None] = {
    "off": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

#: What ``run_epoch`` does when an env runs out of device memory while training.
OOM_POLICIES: tuple[str, ...] = ("raise", "skip_env_epoch")

#: How ``run_epoch`` trains the envs' hosts: each on its own ("per_env"), or envs whose
#: hosts share an architecture as one stacked network (``esper.tolaria.stacked``).
ENGINES: tuple[str, ...] = ("per_env", "stacked")
#: What the ``engine`` setting takes: an engine, or "auto": "stacked" where every env's
#: host is on a GPU (and neither ``compile`` nor ``amp="fp16"`` asks for per-env steps),
#: else "per_env". Why, measured on an H100 (torch 2.11, ``benchmarks/gpu.py``, fresh
#: hosts): stacked trained 1.4x (4 envs) to 7.8x (16 envs) the host steps a second of
#: per_env on the predecessor's host, 3.0x to 6.6x on the GPU-sized one; on a CPU the
#: per-env engine's worker threads win (benchmarks/README.md).
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINES)


class HostTrainingFields(Protocol):
    """The user-set fields of host training, in whichever config holds them
    (:class:`HostTraining`, ``esper.mdp.env_config.EnvConfig``)."""

    on_oom: str
    compile: bool
    amp: str
    cpu_workers: int | None
    engine: str
    cuda_graphs: bool


def check_host_training(config: HostTrainingFields) -> None:
    """The checks of those fields, one list for both configs (named in errors by the
    config's own ``owned_by``)."""
    on_oom, compile, amp = config.on_oom, config.compile, config.amp
    cpu_workers, engine, cuda_graphs = config.cpu_workers, config.engine, config.cuda_graphs
    require_choice("on_oom", on_oom, OOM_POLICIES)
    require_bool("compile", compile)
    require_choice("amp", amp, AMP_DTYPES)
    if cpu_workers is not None:
        require_int("cpu_workers", cpu_workers, 1, hint="or null for every core")
    require_choice("engine", engine, ENGINE_CHOICES)
    require_bool("cuda_graphs", cuda_graphs)
    if engine == "stacked" and (compile or amp == "fp16"):
        setting = "compile=true" if compile else "amp=fp16"
        raise ConfigError(
            "engine",
            f"'stacked' does not run with {setting} (a stacked step is neither compiled nor "
            "scaled per env); use engine=per_env, or turn compile off and amp to off or bf16",
        )
    if cuda_graphs and (compile or amp == "fp16"):
        setting = "compile=true" if compile else "amp=fp16"
        raise ConfigError(
            "cuda_graphs",
            f"does not record a step with {setting} (a compiled step keeps graphs of its "
            "own; an fp16 scaler reads the device on the host); turn compile off and amp "
            "to off or bf16, or cuda_graphs to false",
        )


def autocast_to(
    device_type: str, dtype: torch.dtype | None, cache: bool = True
) -> AbstractContextManager:
    """Autocast to ``dtype`` on ``device_type``; in full precision (None) no autocast
    object at all: a training step's Python holds the lock that the CPU worker threads
    share (``esper.tolaria.parallel``). One object serves several ``with`` blocks.
    ``cache`` False: no cache of cast weights, which a step recorded as a CUDA graph must
    not keep (``esper.tolaria.step_graph``)."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=cache)


@dataclass(frozen=True)
class HostTraining:
    """How every host of a batch of envs trains for an epoch.

    Attributes:
        on_oom: an env out of device memory while training: ``"raise"`` stops with
            ``HostOutOfMemoryError`` naming the env; ``"skip_env_epoch"`` lets that env sit
            out the rest of the epoch's training while the other envs go on.
        compile: run each host's forward and loss (and so its backward) through
            ``torch.compile``.
        amp: autocast for the forward: ``off``, ``bf16`` or ``fp16`` (one ``GradScaler``
            per device, kept by the caller across epochs).
        paired_group: envs per paired group (``esper.mdp.pairing``): every env of a group
            trains on the same share of each batch; None: each env its own share.
        cpu_workers: when every env is on the CPU, envs train in this many threads at
            once (``esper.tolaria.parallel``; None: one per core torch uses, at most one
            per env; 1: one after another). Results equal the sequential path's.
        engine: ``"per_env"`` trains each host on its own (CPU worker threads, CUDA
            streams); ``"stacked"`` trains envs whose hosts share an architecture, and
            whose seeds agree where two have one in a slot, as one network mapped over
            the envs (``esper.tolaria.stacked``: fewer kernel launches, equal results up
            to float rounding), the rest on their own. Not with ``compile`` or
            ``amp="fp16"``. ``"auto"`` (default): stacked where every host is on a GPU
            and neither of those is set, per_env elsewhere (:data:`ENGINE_CHOICES`).
        cuda_graphs: on a GPU each stacked group, and each env that trains on its own,
            records its training step as a CUDA graph once an epoch and replays it
            (``esper.tolaria.step_graph``): a step's launches become one. Results equal
            the unrecorded step's. Not with ``compile`` or ``amp="fp16"``; off the GPU it
            changes nothing.
    """

    on_oom: str = "raise"
    compile: bool = False
    amp: str = "off"
    paired_group: int | None = None
    cpu_workers: int | None = None
    engine: str = "auto"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        with owned_by(self):
            check_host_training(self)
            if self.paired_group is not None:
                require_int("paired_group", self.paired_group, 1)

    def stacks(self, devices: Iterable[torch.device]) -> bool:
        """Whether hosts on ``devices`` train on the stacked engine (``engine`` resolved)."""
        if self.engine != "auto":
            return self.engine == "stacked"
        types = {device.type for device in devices}
        return types == {"cuda"} and not self.compile and self.amp != "fp16"

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp]
