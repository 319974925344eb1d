"""A copy of the policy on another device, where the PPO update runs (``learner_device``).

Why: the policy acts where the hosts train, one forward per env step on the device that
holds the observations (DESIGN.md, step 4). Its update is another matter: ten epochs of
minibatches over a rollout of a few hundred transitions, about six thousand small
operators (benchmarks/README.md, "The PPO update"), each of which a GPU's launching
thread pays for while the GPU waits. On a CUDA fit of 16 envs the update's phase took
0.33-0.43 s (H100, main at 65f9830); the same update on one core of this 2-core VM's CPU
takes 0.09 s (``benchmarks/ppo_update.py --n-envs 16 --episode-epochs 8``). So the update
may run on a copy of the policy on the CPU while the acting policy stays on the GPU.

The acting policy stays the run's record of the weights (its state_dict is what
checkpoints hold). Each update starts by copying its weights into the copy
(:meth:`LearnerCopy.pull`), trains the copy, whose parameters are the optimizer's, and
ends by copying them back (:meth:`LearnerCopy.push`): two transfers of the weights and one
of the batch an update, none in the rollout loop. On one device the copy changes nothing:
the same operators on the same values, so the same weights bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from esper.contracts.config_errors import ConfigError
from esper.devices import check_usable, parse_device

#: The PPOModule argument, as the command line names it.
LEARNER_DEVICE_KEY = "model.learner_device"


def parse_learner_device(value: str | None) -> torch.device | None:
    """``value`` as a device (None: the update runs where the policy acts).

    Raises:
        ConfigError: ``value`` names no device torch knows.
    """
    if value is None:
        return None
    return parse_device(
        value, LEARNER_DEVICE_KEY, " (or be null: the update runs where the policy acts)"
    )


def check_learner_run(device: torch.device | None, world_size: int, precision: str) -> None:
    """A learner copy trains on one process at full precision.

    Raises:
        ConfigError: a device this machine cannot use, more than one rank (DDP averages the gradients of the module's own
            parameters, which the copy's are not) or a precision other than 32-true (its
            scaler and autocast belong to the module's device).
    """
    if device is None:
        return
    check_usable(device, LEARNER_DEVICE_KEY)
    if world_size > 1:
        raise ConfigError(
            LEARNER_DEVICE_KEY,
            f"needs one process, but the run spans {world_size}: under DDP the update's "
            "gradients are averaged on the module's own device; leave it null",
        )
    if precision != "32-true":
        raise ConfigError(
            LEARNER_DEVICE_KEY,
            f"needs --trainer.precision 32-true (the policy's own precision), got {precision!r}; "
            "leave it null to update the policy where it acts",
        )


class LearnerCopy:
    """The policy's copy on ``device``, which the optimizer steps.

    Not an ``nn.Module``: held by the LightningModule as a plain attribute, so Lightning
    neither moves it to its own device nor saves it twice.
    """

    def __init__(self, policy: nn.Module, device: torch.device) -> None:
        self.device = device
        self.policy = copy.deepcopy(policy).to(device)

    def pull(self, acting: nn.Module) -> None:
        """Take ``acting``'s weights (and buffers): after a checkpoint's load, or any
        change made to them between updates, the copy trains from where they are."""
        with torch.no_grad():
            for mine, theirs in zip(_tensors(self.policy), _tensors(acting), strict=True):
                mine.copy_(theirs)

    def push(self, acting: nn.Module) -> None:
        """Give ``acting`` the trained weights."""
        with torch.no_grad():
            for theirs, mine in zip(_tensors(acting), _tensors(self.policy), strict=True):
                theirs.copy_(mine)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
