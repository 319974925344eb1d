"""Optimizer settings for hosts and seeds, checked when the config is built."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from esper.contracts.config_errors import owned_by, require_choice, require_number

#: Learning-rate schedules over an episode (see ``OptimConfig.lr_schedule``).
LR_SCHEDULES: tuple[str, ...] = ("cosine", "constant")
#: Param-group key holding a group's base learning rate (torch's schedulers use the same).
BASE_LR_KEY = "initial_lr"


@dataclass(frozen=True)
class OptimConfig:
    """SGD with momentum for the host and, separately, for each seed.

    Seeds get their own optimizer so that a seed's updates (and its learning rate) never
    touch the host's momentum buffers until it is fossilized.

    Attributes:
        host_lr: base SGD learning rate of the host's parameters, fossilized seeds
            included; the schedule scales it over each episode.
        seed_lr: base SGD learning rate of each live seed's own optimizer, until the seed
            is fossilized.
        momentum: SGD momentum of the host and seed optimizers, in [0, 1).
        weight_decay: SGD weight decay of the host and seed optimizers.
        lr_schedule: `cosine` decays both learning rates over each episode to
            final_lr_fraction of their base, so final accuracy is steadier; `constant`
            keeps them.
        final_lr_fraction: fraction of the base learning rates left at the end of a
            `cosine` episode.
    """

    host_lr: float = 0.05
    seed_lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    #: How the learning rates move over an episode: ``cosine`` decays them from their
    #: base value to ``final_lr_fraction`` of it by the episode's end, so the host
    #: settles and its final accuracy is a figure, not a sample of epoch-to-epoch swings;
    #: ``constant`` keeps them (the late swings of each: benchmarks/README.md, "Design figures kept out of docstrings").
    lr_schedule: str = "cosine"
    #: Fraction of the base learning rates left at the end of a ``cosine`` episode.
    final_lr_fraction: float = 0.0

    def __post_init__(self) -> None:
        with owned_by(self):
            for name in ("host_lr", "seed_lr"):
                require_number(
                    name, getattr(self, name), above=0.0, hint="typical values are 1e-3 to 1e-1"
                )
            require_number("momentum", self.momentum, at_least=0.0, below=1.0)
            require_number("weight_decay", self.weight_decay, at_least=0.0)
            require_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
            require_number("final_lr_fraction", self.final_lr_fraction, at_least=0.0, at_most=1.0)

    def lr_factor(self, progress: float) -> float:
        """Multiplier of the base learning rates at ``progress`` in [0, 1] through an episode."""
        if self.lr_schedule == "constant":
            return 1.0
        p = min(max(progress, 0.0), 1.0)
        floor = self.final_lr_fraction
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))

    def make(
        self, params: Iterable[nn.Parameter], lr: float, factor: float = 1.0
    ) -> torch.optim.Optimizer:
        """SGD at ``lr * factor``, remembering ``lr`` as the group's base for the schedule."""
        optimizer = torch.optim.SGD(
            list(params), lr=lr * factor, momentum=self.momentum, weight_decay=self.weight_decay
        )
        for group in optimizer.param_groups:
            group[BASE_LR_KEY] = lr
        return optimizer
