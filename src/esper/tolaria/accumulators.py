"""One env's running sums over a host epoch, kept on the device.

``run_epoch`` (``esper.tolaria.epoch``) keeps one accumulator per env: loss and correct
counts, whether every loss and every trained seed's gradient stayed finite, and the
seed-only pass of the seeds in TRAINING. Nothing here reads a value on the host; the
caller reads the sums once, in the step's packed transfer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.incubation import IncubationPass, incubating_slots


@dataclass
class EnvAccumulator:
    """One env's running sums, written only on that env's stream.

    The seeds an epoch trains are listed once, at its start: lifecycle ops run between
    epochs, never inside one. Each step then checks every seed gradient in three ops
    (one ``_foreach_norm`` over them all) instead of a norm per slot: a step's Python
    holds the interpreter lock that the worker threads share (``esper.tolaria.parallel``).
    """

    loss_sum: Tensor
    correct: Tensor
    loss_finite: Tensor
    #: Slots of the host (``S``).
    n_slots: int
    #: Parameters of the seeds trained this epoch (slots with a seed optimizer).
    seed_params: list[nn.Parameter]
    #: Per slot with a trained seed: its index and its parameters' span in ``seed_params``.
    seed_spans: list[tuple[int, slice]]
    #: ``[len(seed_params)]`` bool: every gradient of that parameter was finite so far.
    params_finite: Tensor
    #: A finite stand-in for a parameter that got no gradient this step.
    no_grad: Tensor
    #: The seed-only pass of the seeds in TRAINING (None: no slot has one).
    incubation: IncubationPass | None
    seen: int = 0
    #: Of ``seen``, the samples trained in a stacked group (``esper.tolaria.stacked``).
    seen_stacked: int = 0
    #: Set when the env ran out of memory and sat out the rest of the epoch's training.
    skipped: bool = False

    def seed_grads_finite(self) -> Tensor:
        """``[S]`` bool: every gradient of the slot's trained seed was finite this epoch."""
        flags = torch.ones(self.n_slots, device=self.params_finite.device, dtype=torch.bool)
        for s, span in self.seed_spans:
            flags[s] = self.params_finite[span].all()
        return flags


def accumulators(envs: Sequence[GrowingHost]) -> list[EnvAccumulator]:
    """A fresh accumulator for each env, at the start of an epoch."""
    return [accumulator(env) for env in envs]


def accumulator(env: GrowingHost) -> EnvAccumulator:
    """``env``'s accumulator: its trained seeds' parameters listed once, sums at zero."""
    params: list[nn.Parameter] = []
    spans: list[tuple[int, slice]] = []
    for s, slot_id in enumerate(env.slot_ids):
        if slot_id in env.seed_optimizers:
            mine = list(env.model.slot(slot_id).seed_parameters())
            spans.append((s, slice(len(params), len(params) + len(mine))))
            params.extend(mine)
    device = env.device
    incubating = incubating_slots(env.model)
    return EnvAccumulator(
        loss_sum=torch.zeros((), device=device),
        correct=torch.zeros((), device=device, dtype=torch.long),
        loss_finite=torch.ones((), device=device, dtype=torch.bool),
        n_slots=len(env.slot_ids),
        seed_params=params,
        seed_spans=spans,
        params_finite=torch.ones(len(params), device=device, dtype=torch.bool),
        no_grad=torch.zeros((), device=device),
        incubation=IncubationPass(env.model, incubating) if incubating else None,
    )


def finite(values: Tensor) -> Tensor:
    """``torch.isfinite(values)`` in two kernels: ``|x| < inf`` is false for an infinity
    and for NaN. ``torch.isfinite`` runs four (``x == x``, ``abs``, ``!= inf``, their
    product), and the per-step checks run on every step of every env."""
    return values.abs() < math.inf


def update_grad_flags(acc: EnvAccumulator) -> None:
    """AND "this step's gradient is finite" into each trained seed parameter's flag, on
    the device (a gradient is finite where its norm is)."""
    if not acc.seed_params:
        return
    grads = [acc.no_grad if p.grad is None else p.grad for p in acc.seed_params]
    acc.params_finite.logical_and_(finite(torch.stack(torch._foreach_norm(grads))))
