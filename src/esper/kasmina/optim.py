"""Optimizer settings for hosts and seeds, checked when the config is built."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimConfig:
    """SGD with momentum for the host and, separately, for each seed.

    Seeds get their own optimizer so that a seed's updates (and its learning rate) never
    touch the host's momentum buffers until it is fossilized.
    """

    host_lr: float = 0.05
    seed_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4

    def __post_init__(self) -> None:
        for name in ("host_lr", "seed_lr", "momentum", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"OptimConfig.{name} must be a real number, got {value!r}")
        for name in ("host_lr", "seed_lr"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"OptimConfig.{name} must be a finite number > 0, got {value!r}; "
                    "typical values are 1e-3 to 1e-1"
                )
        if not math.isfinite(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"OptimConfig.momentum must be in [0, 1), got {self.momentum!r}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(
                f"OptimConfig.weight_decay must be finite and >= 0, got {self.weight_decay!r}"
            )

    def make(self, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            list(params), lr=lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
