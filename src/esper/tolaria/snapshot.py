"""Snapshots of one env's growing host, for the governor's per-env rollback.

A snapshot must capture the model (host weights, every slot's seed and lifecycle state,
gate refusals included, BatchNorm statistics) and the optimizers (momentum buffers)
*together*: restoring weights without momentum, or a seed without its optimizer, would
resume a different run. One ``deepcopy`` of all three keeps the optimizers pointing at the
copied parameters.

Copies stay on the env's device (device-to-device, no host read); restoring swaps the
copied objects in, so a seed planted or pruned since the snapshot is undone as well.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel


@dataclass(frozen=True)
class HostSnapshot:
    """A frozen copy of one env's host, seeds and optimizers; ``epoch`` says when it was taken."""

    model: HostModel
    host_optimizer: torch.optim.Optimizer
    seed_optimizers: dict[str, torch.optim.Optimizer]
    epoch: int

    @classmethod
    def take(cls, env: GrowingHost, epoch: int) -> HostSnapshot:
        model, host_opt, seed_opts = copy.deepcopy(
            (env.model, env.host_optimizer, env.seed_optimizers)
        )
        return cls(model, host_opt, seed_opts, epoch)

    def restore(self, env: GrowingHost) -> None:
        """Put the snapshot's state back into ``env``; the snapshot stays reusable."""
        model, host_opt, seed_opts = copy.deepcopy(
            (self.model, self.host_optimizer, self.seed_optimizers)
        )
        env.model = model
        env.host_optimizer = host_opt
        env.seed_optimizers = seed_opts
