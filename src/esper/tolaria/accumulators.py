"""One env's running sums over a host epoch, kept on the device.

``run_epoch`` (``esper.tolaria.epoch``) keeps one accumulator per env: loss and correct
counts, whether every loss and every trained seed's gradient stayed finite, and the
seed-only pass of the seeds in TRAINING. Nothing here reads a value on the host; the
caller reads the sums once, in the step's packed transfer.

The envs of an epoch that share a device share one tensor per sum (:class:`DeviceSums`),
each env's accumulator holding views of its row: an epoch starts with four fills and
ends with a few ops for all of them, not five fills and four ops per env, which on a
launch-bound GPU were a third of a 16-env stacked epoch of four batches (132 of 406
kernels). Each env still writes only its own row (CPU worker threads, CUDA streams).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import IncubationPass, incubating_slots
from esper.kasmina.slot import SeedSlot
from esper.tolaria.shares import index_on
from esper.tolaria.step_graph import GraphedStep


@dataclass(eq=False)
class DeviceSums:
    """Every sum of one epoch's envs on one device, a row per env in env order."""

    #: ``[n]`` training loss summed over samples.
    loss_sum: Tensor
    #: ``[n]`` long, correct predictions.
    correct: Tensor
    #: ``[n]`` bool, every training loss was finite.
    loss_finite: Tensor
    #: ``[P]`` bool, every gradient of that trained seed parameter was finite: each
    #: env's parameters after the previous env's.
    params_finite: Tensor
    #: A finite stand-in for a parameter that got no gradient this step (never written).
    no_grad: Tensor


@dataclass
class EnvAccumulator:
    """One env's running sums, written only on that env's stream.

    The seeds an epoch trains are listed once, at its start: lifecycle ops run between
    epochs, never inside one. A step takes every seed gradient's norm in one op
    (``_foreach_norm`` over them all) and keeps it, with its loss and correct count, in
    the ``pending_*`` lists; :meth:`settle` checks and counts them all at the epoch's end
    in a dozen ops. Why not per step: each op is a kernel launch on a GPU, where the
    per-env path is launch-bound, and on a CPU it lets go of and retakes the interpreter
    lock that the worker threads share (``esper.tolaria.parallel``); checking them step
    by step cost eight ops a step of an env with a trained seed. The loss sum stays a
    per-step ``add_``: summed at the end in another order it would round differently.
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
    #: The host, and its slots whose seeds are in TRAINING (their seed-only pass learns).
    model: HostModel
    incubating: list[SeedSlot]
    #: The tensors this accumulator's sums are rows of, and its row there.
    sums: DeviceSums
    row: int
    seen: int = 0
    #: Of ``seen``, the samples trained in a stacked group (``esper.tolaria.stacked``).
    seen_stacked: int = 0
    #: Set when the env ran out of memory and sat out the rest of the epoch's training.
    skipped: bool = False
    #: This epoch's per-step losses (detached), correct counts and seed-gradient norms
    #: (``len(seed_params)`` a step), not yet folded into the sums: :meth:`settle`.
    pending_losses: list[Tensor] = field(default_factory=list)
    pending_correct: list[Tensor] = field(default_factory=list)
    pending_norms: list[Tensor] = field(default_factory=list)
    #: A recorded step's norms, stacked ``[len(seed_params)]`` a step (one copy a replay).
    pending_norm_rows: list[Tensor] = field(default_factory=list)
    #: The env's own step recorded as a CUDA graph this epoch (``esper.tolaria.epoch``
    #: makes it where ``HostTraining.cuda_graphs`` asks); it returns the step's loss,
    #: correct count and stacked seed-gradient norms.
    graphed: GraphedStep[tuple[Tensor, Tensor, Tensor]] | None = None

    def add_loss(self, loss: Tensor, count: int) -> None:
        """A training step's detached ``loss`` (a mean over ``count`` samples) into the
        loss sum: two ops, the step's device work here (:meth:`keep_step` is the rest)."""
        self.loss_sum.add_(loss * count)

    def keep_step(self, loss: Tensor, correct: Tensor, count: int) -> None:
        """The step's ``loss`` and ``correct`` count kept for :meth:`settle`, its samples
        counted: host-side, apart from :meth:`add_loss` so that a step recorded as a CUDA
        graph keeps copies of its fixed outputs at every replay
        (``esper.tolaria.step_graph``)."""
        self.pending_losses.append(loss)
        self.pending_correct.append(correct)
        self.seen += count

    def settle(self) -> None:
        """Fold the pending steps into the sums: the correct counts added, every loss and
        every seed gradient norm checked finite. Exact in any order (integer sums and
        logical ANDs), so the figures equal those of a check at each step."""
        if self.pending_losses:
            self.loss_finite.logical_and_(finite(torch.stack(self.pending_losses)).all())
            self.correct.add_(torch.stack(self.pending_correct).sum())
        if self.pending_norms:
            norms = torch.stack(self.pending_norms).view(-1, len(self.seed_params))
            self.params_finite.logical_and_(finite(norms).all(dim=0))
        if self.pending_norm_rows:
            self.params_finite.logical_and_(finite(torch.stack(self.pending_norm_rows)).all(dim=0))
        self.pending_losses.clear()
        self.pending_correct.clear()
        self.pending_norms.clear()
        self.pending_norm_rows.clear()

    @functools.cached_property
    def incubation(self) -> IncubationPass | None:
        """The seed-only pass of the seeds in TRAINING (None: no slot has one), built the
        first time this env trains on its own this epoch.

        Why not at the epoch's start: listing the host's parameters and buffers is a walk
        of every module (about 1 ms a host on the 2-core VM), and an env that trains in a
        stacked group never needs it (the group runs its members' pass itself)."""
        return IncubationPass(self.model, self.incubating) if self.incubating else None


def accumulators(envs: Sequence[GrowingHost]) -> list[EnvAccumulator]:
    """A fresh accumulator for each env, at the start of an epoch: its sums are views of
    one tensor per sum for all the envs on its device."""
    trained = [_trained_seed_params(env) for env in envs]
    by_device: dict[torch.device, list[int]] = {}
    for i, env in enumerate(envs):
        by_device.setdefault(env.device, []).append(i)
    made: dict[int, EnvAccumulator] = {}
    for device, members in by_device.items():
        counts = [len(trained[i][0]) for i in members]
        sums = DeviceSums(
            loss_sum=torch.zeros(len(members), device=device),
            correct=torch.zeros(len(members), device=device, dtype=torch.long),
            loss_finite=torch.ones(len(members), device=device, dtype=torch.bool),
            params_finite=torch.ones(sum(counts), device=device, dtype=torch.bool),
            no_grad=torch.zeros((), device=device),
        )
        start = 0
        for row, (i, count) in enumerate(zip(members, counts, strict=True)):
            params, spans = trained[i]
            made[i] = EnvAccumulator(
                loss_sum=sums.loss_sum[row],
                correct=sums.correct[row],
                loss_finite=sums.loss_finite[row],
                n_slots=len(envs[i].slot_ids),
                seed_params=params,
                seed_spans=spans,
                params_finite=sums.params_finite[start : start + count],
                no_grad=sums.no_grad,
                model=envs[i].model,
                incubating=incubating_slots(envs[i].model),
                sums=sums,
                row=row,
            )
            start += count
    return [made[i] for i in range(len(envs))]


def accumulator(env: GrowingHost) -> EnvAccumulator:
    """``env``'s accumulator: its trained seeds' parameters listed once, sums at zero."""
    return accumulators([env])[0]


def _trained_seed_params(env: GrowingHost) -> tuple[list[nn.Parameter], list[tuple[int, slice]]]:
    """The parameters of ``env``'s seeds that train this epoch (slots with a seed
    optimizer), and per such slot its index and its parameters' span among them."""
    params: list[nn.Parameter] = []
    spans: list[tuple[int, slice]] = []
    for s, slot_id in enumerate(env.slot_ids):
        if slot_id in env.seed_optimizers:
            mine = list(env.model.slot(slot_id).seed_parameters())
            spans.append((s, slice(len(params), len(params) + len(mine))))
            params.extend(mine)
    return params, spans


def epoch_figures(
    accs: Sequence[EnvAccumulator], device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The envs' ``[E]`` mean training loss and accuracy, ``[E]`` every loss finite and
    ``[E, S]`` every trained seed's gradients finite (True where a slot trains none), on
    ``device``: a few ops per device the envs live on, none per env or seed;
    device-to-device copies, no host read. A mean is the sum over ``max(seen, 1)``
    samples, as each env's own division gives it."""
    groups: dict[int, list[int]] = {}
    for i, acc in enumerate(accs):
        acc.settle()
        groups.setdefault(id(acc.sums), []).append(i)
    parts: list[tuple[Tensor, ...]] = []
    order: list[int] = []
    for members in groups.values():
        sums = accs[members[0]].sums
        if [accs[i].row for i in members] != list(range(sums.loss_sum.shape[0])):
            raise ValueError(
                "epoch_figures needs every accumulator of a device's sums, in their order; "
                "pass the whole list that accumulators() made"
            )
        own = sums.loss_sum.device
        # In the sums' own float dtype, exact for any count a run reaches (2 ** 24);
        # uploaded from pinned memory on CUDA, so nothing waits for the device.
        counts = [max(accs[i].seen, 1) for i in members]
        seen = torch.tensor(counts, dtype=sums.loss_sum.dtype)
        if own.type == "cuda":
            seen = seen.pin_memory()
        seen = seen.to(own, non_blocking=True)
        figures = (
            sums.loss_sum / seen,
            sums.correct / seen,
            sums.loss_finite,
            _slots_finite([accs[i] for i in members], sums.params_finite),
        )
        parts.append(tuple(f.to(device, non_blocking=True) for f in figures))
        order.extend(members)
    joined = [
        torch.cat(column) if len(parts) > 1 else column[0] for column in zip(*parts, strict=True)
    ]
    if order != list(range(len(accs))):
        # The inverse permutation, worked out here and uploaded without a wait.
        back = index_on(device, sorted(range(len(order)), key=order.__getitem__))
        joined = [figure.index_select(0, back) for figure in joined]
    train_loss, train_acc, loss_finite, grads_finite = joined
    return train_loss, train_acc, loss_finite, grads_finite


def _slots_finite(accs: Sequence[EnvAccumulator], flags: Tensor) -> Tensor:
    """``[len(accs), S]``: per env and slot, every flag of the slot's trained parameters
    (``EnvAccumulator.seed_spans``) is true; true where the slot trains none. ``flags``:
    the sums' ``params_finite``, of which each accumulator's is a slice.

    A slot's parameters are one run of ``flags``, so it holds where the running count of
    false flags is the same at both ends of the run: a cumulative sum and a gather for
    every slot at once, with one index uploaded (no atomics, exact). Why: an ``all()``
    per trained seed was 2 launches each, about 45 an epoch at 16 envs."""
    n_slots = accs[0].n_slots
    if not any(acc.seed_spans for acc in accs):
        return torch.ones(len(accs), n_slots, device=flags.device, dtype=torch.bool)
    base = flags.storage_offset()
    # Per cell (env, slot): where its run starts and stops in ``flags``; 0, 0 where the
    # slot trains nothing (an empty run: no false flag in it).
    bounds = [0] * (2 * len(accs) * n_slots)
    for row, acc in enumerate(accs):
        start = acc.params_finite.storage_offset() - base
        for s, span in acc.seed_spans:
            cell = 2 * (row * n_slots + s)
            bounds[cell : cell + 2] = [start + span.start, start + span.stop]
    falses = torch.cumsum(flags.logical_not(), 0)
    counted = torch.nn.functional.pad(falses, (1, 0))  # counted[k]: false flags before k
    ends = counted.index_select(0, index_on(flags.device, bounds)).view(-1, 2)
    return (ends[:, 0] == ends[:, 1]).view(len(accs), n_slots)


def finite(values: Tensor) -> Tensor:
    """``torch.isfinite(values)`` in two kernels: ``|x| < inf`` is false for an infinity
    and for NaN. ``torch.isfinite`` runs four (``x == x``, ``abs``, ``!= inf``, their
    product), and the per-step checks run on every step of every env."""
    return values.abs() < math.inf


def seed_grad_norms(acc: EnvAccumulator) -> list[Tensor]:
    """This step's norm of each of ``acc``'s trained seed parameters' gradients (none
    where it trains no seed), for :meth:`EnvAccumulator.settle` to AND "finite" into
    their flags once kept in ``pending_norms`` (a gradient is finite where its norm is):
    one op a step, on the device."""
    if not acc.seed_params:
        return []
    grads = [acc.no_grad if p.grad is None else p.grad for p in acc.seed_params]
    return list(torch._foreach_norm(grads))
