"""Training the hosts of several envs as one stacked network (``HostTraining.engine="stacked"``).

Why: a host of the predecessor's size is a few dozen small kernels a training step, so on
a GPU the per-env path is launch-bound, and adding envs adds launches, not work. Envs
whose hosts have the same architecture, the same seeds in the same stages and the same
optimizer settings differ only in their tensors, so their steps can run as one: every
parameter, buffer and momentum buffer stacked along a leading env dimension, the forward
mapped over it with ``torch.func.vmap`` (one grouped kernel where the per-env path
launched one per env; a batch norm folds the envs into its channels, one fused kernel as
each env's own step runs: ``esper.tolaria.stacked_norm``), one backward, one SGD step
over the stacked tensors. A seed just planted counts as no seed: no pass of the step runs
it. A gate that some members' seeds
have and others' lack is run for all of them, at a logit of +inf (a factor of exactly 1)
on the rows of those that lack it. A seed blending in (BLENDING, HOLDING) that some
members lack is run for all of them, at an alpha of 0 on the rows of those that lack it:
its input is detached, so their outputs and gradients are the host's alone. Seeds in
TRAINING, which the host's pass goes through, are run by the incubation pass for every
member, scaled by 0 on the rows of those that lack them (they keep nothing of them).
Envs whose layers merged different widenings (a wider stage, and wider inputs of the layer
after it) train as one group where the host's forward is exact on zero-padded layers
(``HostModel.pads_widths_exactly``) and every seed they run is a widening: each tensor is
stacked at the widest member's size, a narrower member's rows zero-padded at the end of
each dimension (its padded channels compute zeros and get zero gradients, so they stay
zero), and written back at the member's own size. A member whose seed is in TRAINING
where the template blends the same seed in trains with it: the template's forward runs
the seed at alpha 0 on that member's row in the host's pass (as its own TRAINING slot
passes the activation on) and at alpha 1 in the incubation pass, in which only the
TRAINING rows' seed tensors learn, and each pass's moves of the seed's statistics are
kept only on the rows whose own step would make them.

Which envs form a group is decided in ``esper.tolaria.stack_grouping``, and what its
members share and where they differ is read once as it forms
(``esper.tolaria.stacked_plan``). A group is formed at the start of an epoch, validates
from its stacked tensors at the end (``esper.tolaria.stacked_validation``) and is then
written back into its envs: lifecycle ops, rollback and checkpoints run between epochs on
the envs' own tensors, as before. On a GPU, with ``HostTraining.cuda_graphs``, its step
is recorded as a CUDA graph once a group epoch and replayed (``esper.tolaria.step_graph``):
the step's device work is kept apart from its host-side bookkeeping for that. Within an
epoch nothing changes which parameters exist, so the grouping holds. What cannot be
stacked trains on the per-env path: an env alone in its group, a batch whose shares
differ in size from the first batch's (a loader's shorter last batch; the group is
written back first), and a group that ran out of memory (its envs finish the epoch
alone). A batch that does not split evenly over the envs gives some envs
one row more: groups are split there at the epoch's first batch
(``esper.tolaria.shares.by_share_size``) and stack every batch of that size. Members left
no rows by a short batch make no step.

Results equal the per-env path's up to float rounding: the elementwise work (SGD, batch
norm statistics, the blend) is the same arithmetic, while a stacked convolution or matrix
product sums in another order. ``tests/tolaria/test_stacked.py`` states and checks the
tolerance. A stacked forward runs one host as the template with the group's tensors
swapped in (``esper.tolaria.swapped``), so everything that steers the forward in
Python (seed types and blueprints, what a stage does) is part of the group's key or of
what members that have it must agree on, and the template runs every gate, seed
blending in and seed in TRAINING any member has: a member that has them all, or, where
none does, a copy of one member's host with the other members' seeds' slots copied in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.func import vmap

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import seeds_incubating
from esper.kasmina.sgd import MOMENTUM_BUFFER, sgd_step
from esper.tolaria.accumulators import EnvAccumulator, finite
from esper.tolaria.copies import Copies
from esper.tolaria.counterfactual import CounterfactualPlan, contributing_slots
from esper.tolaria.host_training import autocast_to
from esper.tolaria.shares import uploaded
from esper.tolaria.stack_grouping import (
    MIN_GROUP,
    EnvView,
)
from esper.tolaria.stacked_norm import batch_norms, batch_norms_unfolded
from esper.tolaria.stacked_plan import GroupPlan
from esper.tolaria.step_graph import GraphedStep, recorder_for, tensor_layout
from esper.tolaria.swapped import Swapped

#: A missing gate's logit in a group's forward: sigmoid(inf) is exactly 1, so the seed's
#: output passes unchanged both ways, and the logit's own gradient, ``s * (1 - s)``, is 0.
_NO_GATE_LOGIT = float("inf")


class StackedGroup:
    """Envs of one key (``esper.tolaria.stack_grouping.stack_key``) training as one network
    for an epoch.

    ``step`` takes each member's share of a batch stacked ``[G, b, ...]``; ``write_back``
    puts parameters, buffers, momentum and the epoch's sums into the members (their
    :class:`EnvAccumulator` s) and may be called at any point: the next ``step`` stacks
    the members afresh.
    """

    def __init__(
        self,
        envs: Sequence[GrowingHost],
        accs: Sequence[EnvAccumulator],
        views: Sequence[EnvView] | None = None,
        graphs: bool = False,
    ) -> None:
        if len(envs) < MIN_GROUP or len(envs) != len(accs):
            raise ValueError(
                f"a stacked group needs at least {MIN_GROUP} envs and one accumulator each, "
                f"got {len(envs)} envs and {len(accs)} accumulators"
            )
        self.envs = list(envs)
        self.accs = list(accs)
        self.plan = GroupPlan.of(
            self.envs, self.accs, views or [EnvView.of(env) for env in self.envs]
        )
        #: The model that runs every member's forward (``GroupPlan.template``).
        self.template = self.plan.template
        #: The template's batch norms, run with the envs folded into channels
        #: (``esper.tolaria.stacked_norm``): one fused kernel each, as each env's own step.
        self._norms = batch_norms(self.template)
        self._forward = vmap(_forward(self.template), randomness="different")
        self._stacked: _Stacked | None = None
        #: Records the step as a CUDA graph (``esper.tolaria.step_graph``): None where
        #: not asked for, or where the group's device has no recorder.
        self._recorder = recorder_for(self.envs[0].device) if graphs else None

    @property
    def size(self) -> int:
        return len(self.envs)

    # ------------------------------------------------------------------ training
    def step(self, x: Tensor, y: Tensor, autocast_dtype: torch.dtype | None = None) -> None:
        """One training step of every member on its share: ``x [G, b, ...]``, ``y [G, b]``."""
        if x.shape[0] != self.size or y.shape[0] != self.size:
            raise ValueError(
                f"a stacked step of {self.size} envs needs shares stacked [{self.size}, ...], "
                f"got x {list(x.shape)} and y {list(y.shape)}"
            )
        stacked = self._stacked if self._stacked is not None else self._stack()
        self._stacked = stacked
        self.template.check_input(x[0])  # host-side shape check, outside vmap

        if self._recorder is None:
            self._device_step(stacked, x, y, autocast_dtype)
        else:
            if stacked.graphed is None:
                step = functools.partial(self._device_step, stacked, autocast_dtype=autocast_dtype)
                shapes = self._shapes(stacked, autocast_dtype)
                stacked.graphed = GraphedStep(step, self._recorder, shapes=shapes)
            x, y, _ = stacked.graphed(x, y)  # where the step read them: its inputs if replayed
        # Host-side bookkeeping, at every step: a replayed graph repeats device work only.
        stacked.seen += y[0].numel()
        stacked.last_batch = (x, y)

    def _shapes(self, stacked: _Stacked, autocast_dtype: torch.dtype | None) -> Hashable:
        """What this group's step's kernels and their shapes depend on besides the batch:
        a step of equal ``shapes`` ran its kernels before (``GraphedStep``). Its first call
        makes nothing (``_stack`` made every momentum buffer and masked alpha), so it may
        be the one recorded."""
        return (
            type(self.template),
            autocast_dtype,
            tuple(slot.slot_id for slot in self.plan.incubating),
            tuple(slot.alpha for slot in self.plan.mixed),
            tuple((name, tensor_layout(p)) for name, p in stacked.params.items()),
            tuple((name, tensor_layout(b)) for name, b in stacked.buffers.items()),
        )

    def _device_step(
        self, stacked: _Stacked, x: Tensor, y: Tensor, autocast_dtype: torch.dtype | None
    ) -> None:
        """The step's device work: nothing in it reads the device on the host or changes
        what a later step reads on the host, so a CUDA graph may hold it."""
        # The forward moves buffers in place (batch-norm statistics, an incubating seed's
        # own): kept, so that a step that runs out of memory leaves the group as it was
        # and its members retrain the batch alone from there (``esper.tolaria.epoch``).
        # Parameters, momentum and optimizer state move only after the SGD step has made
        # its last allocation (``esper.kasmina.sgd``).
        buffers = list(stacked.buffers.values())
        torch._foreach_copy_(stacked.buffers_before, buffers)
        try:
            self._step(stacked, x, y, autocast_dtype)
        except torch.OutOfMemoryError:
            torch._foreach_copy_(buffers, stacked.buffers_before)
            for p in stacked.params.values():
                p.grad = None
            raise

    def _step(
        self, stacked: _Stacked, x: Tensor, y: Tensor, autocast_dtype: torch.dtype | None
    ) -> None:
        # A step recorded as a graph keeps no autocast cache of cast weights.
        autocast = autocast_to(x.device.type, autocast_dtype, cache=self._recorder is None)
        for p in stacked.params.values():
            p.grad = None
        with self.template.mapped(), batch_norms_unfolded(self._norms), autocast:
            params, buffers = _with_missing(stacked, stacked.params, stacked.buffers)
            loss, correct = self.template.loss_and_correct_per_env(
                self._forward(params, buffers, x), y
            )
        loss.sum().backward()
        if stacked.mixed:
            self._undo_host_pass_statistics(stacked)
        if self.plan.incubating or stacked.mixed:
            self._incubation_backward(stacked, x, y, autocast)
        self._update_grad_flags(stacked)
        sgd_step(stacked.optimizers)
        if stacked.learned is None:  # which ones learn is the same at every step
            fresh = stacked.fresh_momentum
            stacked.learned = {name for name in fresh if stacked.params[name].grad is not None}
        loss = loss.detach()
        stacked.loss_sum.add_(loss * y[0].numel())
        stacked.correct.add_(correct)
        stacked.loss_finite.logical_and_(finite(loss))

    def _incubation_backward(
        self, stacked: _Stacked, x: Tensor, y: Tensor, autocast: AbstractContextManager
    ) -> None:
        """The seed-only pass of the members' seeds in TRAINING (``esper.kasmina.incubation``):
        host parameters out of autograd, host buffers on copies, seeds at alpha 1."""
        # A mixed slot's seed runs at alpha 0 on its other rows here (``_with_missing``):
        # their gradients from this pass are exact zeros, so only TRAINING rows learn;
        # where it keeps their alpha, this pass's gradient reaches its TRAINING rows only
        # (a hook on the stacked tensor: one ``where`` in the backward, none forward).
        masked = {name: rows for mixed in stacked.mixed for name, rows in mixed.params.items()}
        params = {
            name: p if name in self.plan.learning_names else p.detach()
            for name, p in stacked.params.items()
        }
        hooks = [
            stacked.params[name].register_hook(functools.partial(_on_rows, rows))
            for name, rows in masked.items()
        ]
        # The host's buffers as the host's pass left them, on the group's copies (one
        # multi-tensor copy, not a clone each), and a mixed slot's seed statistics as
        # they are: those move for its TRAINING rows here and are put back on the others.
        copies, sources = stacked.incubation_copies
        if copies:
            with torch.no_grad():
                torch._foreach_copy_(copies, sources)
        norms = batch_norms_unfolded(self._norms)
        incubating = seeds_incubating(self.plan.incubating, self.plan.scaled)
        with self.template.mapped(), norms, incubating, autocast:
            params, buffers = _with_missing(
                stacked, params, stacked.incubation_buffers, incubating=True
            )
            seed_loss, _ = self.template.loss_and_correct_per_env(
                self._forward(params, buffers, x), y
            )
        try:
            seed_loss.sum().backward()
        finally:
            for hook in hooks:
                hook.remove()
        with torch.no_grad():
            for moved, before, rows in stacked.kept:
                torch.where(rows, moved, before, out=moved)

    @torch.no_grad()
    def _undo_host_pass_statistics(self, stacked: _Stacked) -> None:
        """Put back what the host's pass moved of a mixed slot's seed statistics on its
        TRAINING rows: a seed in TRAINING updates them in its incubation pass only."""
        for moved, before, rows in stacked.undo:
            torch.where(rows, before, moved, out=moved)

    def _update_grad_flags(self, stacked: _Stacked) -> None:
        """AND "this step's gradient is finite" into each member's trained-seed flags."""
        if not self.plan.seed_names:
            return
        # Each member's row of each gradient, its norm taken by one multi-tensor op (as
        # each env's own step takes its parameters' norms: ``seed_grad_norms``), not a
        # per-row norm kernel per parameter.
        rows: list[Tensor] = []
        for name in self.plan.seed_names:
            grad = stacked.params[name].grad
            rows += (stacked.no_grad if grad is None else grad.reshape(self.size, -1)).unbind()
        norms = torch.stack(torch._foreach_norm(rows)).view(len(self.plan.seed_names), -1)
        stacked.params_finite.logical_and_(finite(norms.T))

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validation_sums(
        self, batches: Sequence[tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor, list[list[int]], int]:
        """Every member's validation on ``batches`` (on the group's device) as one mapped
        evaluation forward a batch: per member and replica its summed loss ``[G, R]`` and
        correct predictions ``[G, R]``, per member the replica of each slot's
        counterfactual (``CounterfactualPlan.slot_to_replica``: 0 where the member has no
        seed to switch off there), and the samples seen.

        The template forks a replica at every seed any member blends in, in its forward
        order (``esper.tolaria.counterfactual``); a member that lacks one runs it at alpha
        0, so that replica is its own base one, and it reads only its own seeds'
        replicas. It reads the group's stacked tensors where it holds them (its training
        epoch's end, before ``write_back``), else the members' own, stacked afresh; it
        changes neither."""
        stacked = self._stacked if self._stacked is not None else self._stack()
        plan = CounterfactualPlan(self.template)
        replica_of = dict(zip(self.template.slot_ids, plan.slot_to_replica, strict=True))
        own = [{slot.slot_id for slot in contributing_slots(env.model)} for env in self.envs]
        to_replica = [
            [replica_of[slot_id] if slot_id in mine else 0 for slot_id in env.slot_ids]
            for env, mine in zip(self.envs, own, strict=True)
        ]
        forward = vmap(_forward(self.template), in_dims=(0, 0, None))
        loss_sum = torch.zeros(self.size, plan.replicas, device=stacked.loss_sum.device)
        correct = torch.zeros_like(loss_sum, dtype=torch.long)
        seen = 0
        # The template alone runs (the members' tensors swapped in), so it alone needs
        # evaluation mode; switching every member too walked each host's modules twice an
        # epoch for nothing.
        self.template.eval()
        try:
            for x, y in batches:
                with self.template.mapped(), batch_norms_unfolded(self._norms):
                    params, buffers = _with_missing(stacked, stacked.params, stacked.buffers)
                    outputs = forward(params, buffers, x)
                losses, right = self.template.loss_and_correct_per_replica_per_env(
                    outputs, y, plan.replicas
                )
                loss_sum.add_(losses)
                correct.add_(right)
                seen += y.numel()
        finally:
            plan.clear()
            self.template.train()
        return loss_sum, correct, to_replica, seen

    # ------------------------------------------------------------------ stacking
    def _stack(self) -> _Stacked:
        """Every member's tensors stacked along a new first dimension (copies, made by a few
        multi-tensor copies: ``esper.tolaria.copies``)."""
        shapes, copies = self.plan.shapes, Copies()
        params = {
            name: _stacked_rows(
                [mine.get(name) for mine in self.plan.params], shapes[name], p, copies
            )
            for name, p in self.plan.like_params.items()
        }
        buffers = {
            name: _stacked_rows(
                [mine.get(name) for mine in self.plan.buffers], shapes[name], b, copies
            )
            for name, b in self.plan.like_buffers.items()
        }
        optimizers = []
        fresh_momentum: set[str] = set()
        for (lr, momentum, decay), names in self.plan.sgd_groups.items():
            leaves = [params[name] for name in names]
            optimizer = torch.optim.SGD(leaves, lr=lr, momentum=momentum, weight_decay=decay)
            for name, leaf in zip(names, leaves, strict=True):
                # A member without a buffer (its first step, or without the tensor) gets a
                # row of zeros: ``0 * momentum + grad`` is the gradient, as torch starts a
                # buffer. ``write_back`` gives a member that has the tensor its buffer.
                buffers_of = [
                    _momentum_of(*owners[name]) if name in owners else None
                    for owners in self.plan.owners
                ]
                had = next((b for b in buffers_of if b is not None), None)
                if had is not None:
                    stacked_buffer = _stacked_rows(buffers_of, shapes[name], had, copies)
                elif momentum != 0:
                    # None has one: rows of zeros too, so that the first step makes no
                    # buffer and may be recorded (``_shapes``). Its members get it only if
                    # the tensor learned (``write_back``), as a step of their own makes it.
                    stacked_buffer = leaf.new_empty(leaf.shape)
                    copies.zero(stacked_buffer)
                    fresh_momentum.add(name)
                else:
                    continue
                optimizer.state[leaf][MOMENTUM_BUFFER] = stacked_buffer
            optimizers.append(optimizer)
        copies.run()
        for name, p in self.plan.like_params.items():
            params[name].requires_grad_(p.requires_grad)
        device = next(iter(params.values())).device

        def members_with(name: str | None) -> tuple[bool, ...]:
            """Per member, whether it has ``name``."""
            return tuple(name in mine for mine in self.plan.params)

        partial = (
            *self.plan.partial_gates,
            *self.plan.partial_alphas.values(),
            *self.plan.partial_incubations.values(),
        )
        masks = _row_masks(
            [members_with(name) for name in partial]
            + [tuple(rows) for slot in self.plan.mixed for rows in (slot.blending, slot.training)],
            device,
        )

        def rows_of(flags: Sequence[bool], dims: int) -> Tensor:
            """``[G, 1, ...]`` bool (``dims`` dimensions), true on the rows ``flags`` name: a
            read-only view of the uploaded row of ``masks``."""
            return masks[tuple(flags)].view(-1, *([1] * (dims - 1)))

        mixed = [
            _MixedRows(
                alpha=slot.alpha,
                blending=rows_of(slot.blending, buffers[slot.alpha].dim()),
                training_alpha=rows_of(slot.training, buffers[slot.alpha].dim()).to(
                    buffers[slot.alpha].dtype
                ),
                keeps_alpha=slot.keeps_alpha,
                params={
                    name: rows_of(slot.training, params[name].dim())
                    for name in (slot.params if slot.keeps_alpha else ())
                },
                buffers={
                    name: rows_of(slot.training, buffers[name].dim()) for name in slot.buffers
                },
            )
            for slot in self.plan.mixed
        ]
        # Filled where they are read: each step copies its buffers in as it starts.
        buffers_before = {name: torch.empty_like(b) for name, b in buffers.items()}
        # The incubation pass's buffers: copies of the host's (its forward moves their
        # statistics, which the host's must not see), the incubating seeds' own and a
        # mixed slot's seed statistics as they are (``kept``: restored on the rows the
        # pass must not move, from copies taken with the others).
        kept_names = {name for slot in mixed for name in slot.buffers}
        copied = {  # filled as each incubation pass starts
            name: torch.empty_like(b)
            for name, b in buffers.items()
            if name not in self.plan.incubating_buffers or name in kept_names
        }
        incubation_buffers = {
            name: b if name in self.plan.incubating_buffers or name in kept_names else copied[name]
            for name, b in buffers.items()
        }
        stacked = _Stacked(
            params=params,
            buffers=buffers,
            mixed=mixed,
            undo=[
                (buffers[name], buffers_before[name], rows)
                for slot in mixed
                for name, rows in slot.buffers.items()
            ],
            incubation_buffers=incubation_buffers,
            incubation_copies=(list(copied.values()), [buffers[name] for name in copied]),
            kept=[
                (buffers[name], copied[name], rows)
                for slot in mixed
                for name, rows in slot.buffers.items()
            ],
            gate_masks={
                name: rows_of(members_with(name), params[name].dim())
                for name in self.plan.partial_gates
            },
            alpha_masks={
                alpha: rows_of(members_with(seed), buffers[alpha].dim())
                for alpha, seed in self.plan.partial_alphas.items()
            },
            incubation_masks={
                scale: rows_of(members_with(seed), buffers[scale].dim())
                for scale, seed in self.plan.partial_incubations.items()
            },
            buffers_before=list(buffers_before.values()),
            optimizers=optimizers,
            loss_sum=torch.zeros(self.size, device=device),
            correct=torch.zeros(self.size, device=device, dtype=torch.long),
            loss_finite=torch.ones(self.size, device=device, dtype=torch.bool),
            params_finite=torch.ones(
                self.size, len(self.plan.seed_names), device=device, dtype=torch.bool
            ),
            no_grad=torch.zeros(self.size, device=device),
            fresh_momentum=fresh_momentum,
        )
        # The alphas and scales the passes read, made now, not at the first step (which
        # so makes nothing, and may be recorded): alphas do not move within an epoch.
        # The incubation pass's come from the group's buffers, not their copies (filled
        # as that pass starts): equal values, since the host's pass moves no alpha or scale.
        passes = (False, True) if self.plan.incubating or mixed else (False,)
        stacked.masked_buffers = {
            incubating: _masked_buffers(stacked, buffers, incubating) for incubating in passes
        }
        return stacked

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the stacked tensors and sums into the members (a few multi-tensor ops:
        ``esper.tolaria.copies``); nothing is read on the host."""
        stacked, self._stacked = self._stacked, None
        if stacked is None:
            return
        # Its step refers back to it: let the graph and its memory go now, not at the
        # collector's next full pass.
        stacked.graphed = None
        copies = Copies()
        for tensors, members in (
            (stacked.params, self.plan.params),
            (stacked.buffers, self.plan.buffers),
        ):
            for name, stacked_tensor in tensors.items():
                for mine, row in zip(members, stacked_tensor.detach().unbind(), strict=True):
                    if name in mine:
                        copies.add(mine[name], _unpadded(row, mine[name].shape))
        leaves = {id(p): name for name, p in stacked.params.items()}
        for optimizer in stacked.optimizers:
            for leaf, state in optimizer.state.items():
                buffer = state.get(MOMENTUM_BUFFER)
                if buffer is None:
                    continue
                name = leaves[id(leaf)]
                if name in stacked.fresh_momentum and name not in (stacked.learned or ()):
                    continue  # never stepped: a member's own step would have made none
                for owners, row in zip(self.plan.owners, buffer.unbind(), strict=True):
                    if name not in owners:  # an optional tensor this member lacks
                        continue
                    owner, param = owners[name]
                    mine, row = _momentum_of(owner, param), _unpadded(row, param.shape)
                    if mine is None:  # its first step was a stacked one
                        mine = owner.state[param][MOMENTUM_BUFFER] = row.new_empty(param.shape)
                    copies.add(mine, row)
        copies.run()
        # The epoch's sums, one multi-tensor op each (a bool product is a logical and).
        accs = self.accs
        torch._foreach_add_([acc.loss_sum for acc in accs], list(stacked.loss_sum.unbind()))
        torch._foreach_add_([acc.correct for acc in accs], list(stacked.correct.unbind()))
        flags = [acc.loss_finite for acc in accs]
        ours = list(stacked.loss_finite.unbind())
        for g, acc in enumerate(accs):
            for mine, span in self.plan.flag_spans[g]:
                flags.append(acc.params_finite[mine])
                ours.append(stacked.params_finite[g, span])
        torch._foreach_mul_(flags, ours)
        for g, (env, acc) in enumerate(zip(self.envs, accs, strict=True)):
            acc.seen += stacked.seen
            acc.seen_stacked += stacked.seen
            env.zero_grad()
            if stacked.last_batch is not None:
                x, y = stacked.last_batch
                env.probe = (x[g], y[g])


@dataclass(frozen=True)
class _MixedRows:
    """A :class:`~esper.tolaria.stacked_plan.MixedSlot`'s rows on the device, each mask
    ``[G, 1, ...]`` shaped for its tensor: the members blending the seed in (for its
    alpha in the host's pass), the TRAINING members as alpha (1 there, 0 elsewhere: the
    incubation pass's), and the TRAINING members for each seed buffer and, where the
    slot keeps the blending members' alpha in the incubation pass, for each seed
    parameter (only those rows learn there)."""

    alpha: str
    blending: Tensor
    training_alpha: Tensor
    keeps_alpha: bool
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]


@dataclass
class _Stacked:
    """A group's tensors while it trains stacked (``[G, ...]`` each), and its running sums."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    #: Per slot of ``GroupPlan.mixed``, its rows.
    mixed: list[_MixedRows]
    #: Per gate some member lacks: ``[G, 1, ...]`` bool, the members that have it.
    gate_masks: dict[str, Tensor]
    #: Per alpha of a seed blending in that some member lacks: ``[G]`` bool, the members
    #: that have the seed.
    alpha_masks: dict[str, Tensor]
    #: Per incubation scale of a seed in TRAINING that some member lacks: the same.
    incubation_masks: dict[str, Tensor]
    #: ``buffers`` as the running step found them (in their order).
    buffers_before: list[Tensor]
    #: Per seed statistic of a mixed slot: the buffer, its entry of ``buffers_before`` and
    #: its TRAINING rows (``StackedGroup._undo_host_pass_statistics``).
    undo: list[tuple[Tensor, Tensor, Tensor]]
    #: The buffers the incubation pass runs on, by name: copies of the host's.
    incubation_buffers: dict[str, Tensor]
    #: ``(copies, sources)``: refreshed by one multi-tensor copy before each pass.
    incubation_copies: tuple[list[Tensor], list[Tensor]]
    #: Per seed statistic of a mixed slot: the buffer, its copy from before the
    #: incubation pass and its TRAINING rows, the only ones that pass may move.
    kept: list[tuple[Tensor, Tensor, Tensor]]
    optimizers: list[torch.optim.Optimizer]
    loss_sum: Tensor
    correct: Tensor
    loss_finite: Tensor
    #: ``[G, len(seed names)]``: every gradient of that member's trained seed parameter
    #: was finite so far.
    params_finite: Tensor
    #: ``[G]`` finite stand-in norms for a seed parameter that got no gradient.
    no_grad: Tensor
    seen: int = 0
    last_batch: tuple[Tensor, Tensor] | None = None
    #: The group epoch's step as a CUDA graph, made at its first step where recorded.
    graphed: GraphedStep[None] | None = None
    #: The masked alphas and scales ``_with_missing`` puts in the buffers, for the host's
    #: pass and validation (False) and the incubation pass (True): they change only
    #: between epochs, when lifecycle ops move them, so each is made once a group epoch,
    #: by ``StackedGroup._stack``.
    masked_buffers: dict[bool, dict[str, Tensor]] = field(default_factory=dict)
    #: Parameters whose momentum buffer the stacking made, none of their members having
    #: one: a member gets it only where the parameter learned (had a gradient).
    fresh_momentum: set[str] = field(default_factory=set)
    #: Of those, the ones a completed step gave a gradient (None: no step completed yet).
    #: Noted on the host at a step that runs its Python (a replay runs none; which
    #: parameters get a gradient is the same at every step of the group epoch).
    learned: set[str] | None = None


def _with_missing(
    stacked: _Stacked,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    incubating: bool = False,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``params`` with each gate some member lacks set to :data:`_NO_GATE_LOGIT` on that
    member's row (its gradient there is 0, and the row is never written back), and
    ``buffers`` with the alpha of each seed blending in that some member lacks (and, in
    the incubation pass, the scale of each seed in TRAINING that some member lacks) set
    to 0 on that member's row: its seed rows then add exactly nothing. At a mixed slot
    (``GroupPlan.mixed``) a member incubating the seed runs it at alpha 0 in the
    host's pass, as its own TRAINING slot passes the host's activation on, and at alpha 1
    in the incubation pass (and its seed's gate, which TRAINING does not run, as 1); the
    other members run it at their alpha in the host's pass and at 0 in the incubation
    pass, which so gives their seed rows exact zeros (they learn from the host's pass),
    unless one that blends it in incubates a seed (``MixedSlot.keeps_alpha``): then at
    their alpha there too, and ``StackedGroup`` masks the seed's rows instead."""
    if stacked.gate_masks:
        params = params | {
            name: torch.where(has, params[name], _NO_GATE_LOGIT)
            for name, has in stacked.gate_masks.items()
        }
    masked = stacked.masked_buffers[incubating]
    if masked:
        buffers = buffers | masked
    return params, buffers


def _masked_buffers(
    stacked: _Stacked, buffers: dict[str, Tensor], incubating: bool
) -> dict[str, Tensor]:
    """The alphas and incubation scales :func:`_with_missing` replaces, as it replaces
    them (its docstring says how)."""
    masks = stacked.alpha_masks | (stacked.incubation_masks if incubating else {})
    masked = {name: torch.where(has, buffers[name], 0.0) for name, has in masks.items()}
    for mixed in stacked.mixed:  # a seed some members blend in and others incubate
        alpha = masked.get(mixed.alpha, buffers[mixed.alpha])
        if not incubating:
            masked[mixed.alpha] = torch.where(mixed.blending, alpha, 0.0)
        elif mixed.keeps_alpha:
            masked[mixed.alpha] = torch.where(mixed.blending, alpha, mixed.training_alpha)
        else:
            masked[mixed.alpha] = mixed.training_alpha
    return masked


def _on_rows(rows: Tensor, grad: Tensor) -> Tensor:
    """``grad`` on ``rows`` (``[G, 1, ...]`` bool), exact zeros on the others."""
    return torch.where(rows, grad, 0.0)


def _momentum_of(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor | None:
    """``param``'s momentum buffer, read without adding an empty state for it (an
    optimizer's state is a defaultdict, and what it holds goes into checkpoints)."""
    state = optimizer.state.get(param)
    return None if state is None else state.get(MOMENTUM_BUFFER)


def _row_masks(
    patterns: Sequence[tuple[bool, ...]], device: torch.device
) -> dict[tuple[bool, ...], Tensor]:
    """Each distinct pattern of ``patterns`` (one flag per member) as a ``[G]`` bool row
    on ``device``: one table of them all, uploaded by one copy that does not wait for the
    device (``esper.tolaria.shares.uploaded``). Why: made by fills, a run of true rows at a
    time, a group's masks were about 15 launches an epoch at 16 envs."""
    distinct = list(dict.fromkeys(patterns))
    if not distinct:
        return {}
    table = uploaded(device, distinct, torch.bool)
    return dict(zip(distinct, table.unbind(), strict=True))


def _stacked_rows(
    rows: Sequence[Tensor | None], shape: torch.Size, like: Tensor, copies: Copies
) -> Tensor:
    """A ``[len(rows), *shape]`` tensor like ``like`` whose row ``g`` is ``rows[g]``
    zero-padded at the end of each dimension (zeros where None), its zeroing and copies
    left to ``copies``."""
    out = like.new_empty((len(rows), *shape))
    if not all(row is not None and row.shape == shape for row in rows):
        copies.zero(out)
    for row, tensor in zip(out.unbind(), rows, strict=True):
        if tensor is not None:
            copies.add(_unpadded(row, tensor.shape), tensor)
    return out


def _unpadded(row: Tensor, shape: torch.Size) -> Tensor:
    """A member's ``shape`` of a stacked row (a view; the row itself where equal)."""
    return row if row.shape == shape else row[_corner(shape)]


def _corner(shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(0, size) for size in shape)


def _forward(template: HostModel) -> Callable[[dict, dict, Tensor], Tensor]:
    """One member's forward, with its tensors swapped into the template
    (:class:`~esper.tolaria.swapped.Swapped`). Its loss is taken outside ``vmap``, for
    every member at once (``loss_and_correct_per_env``)."""
    swapped = Swapped(template)

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        return swapped(params, buffers, x)

    return forward
