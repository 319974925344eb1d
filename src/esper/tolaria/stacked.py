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

Which envs form a group is decided in ``esper.tolaria.stack_grouping``. A group is
formed at the start of an epoch, validates from its stacked tensors at the end
(``esper.tolaria.stacked_validation``) and is then written back into its envs: lifecycle
ops, rollback and checkpoints run between epochs on the envs' own tensors, as before.
Within an epoch nothing changes which parameters exist, so the grouping holds. What
cannot be stacked trains on the per-env path: an env alone in its group, a batch whose
shares differ in size from the first batch's (a loader's shorter last batch; the group is
written back first), and a group that ran out of memory (its envs finish the epoch
alone). A batch that does not split evenly over the envs gives some envs one row more:
groups are split there at the epoch's first batch (``esper.tolaria.shares.by_share_size``)
and stack every batch of that size. Members left no rows by a short batch make no step.

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
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import vmap

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import incubating_slots, seeds_incubating
from esper.kasmina.sgd import MOMENTUM_BUFFER, sgd_step
from esper.kasmina.slot import SeedSlot
from esper.tolaria.accumulators import EnvAccumulator, finite
from esper.tolaria.copies import Copies
from esper.tolaria.counterfactual import CounterfactualPlan, contributing_slots
from esper.tolaria.host_tensors import HostTensors
from esper.tolaria.host_training import autocast_to
from esper.tolaria.stack_grouping import (
    BLEND_STAGES,
    GATE_STAGES,
    IDLE_STAGES,
    MIN_GROUP,
    EnvView,
    blending_slots,
    gate_tensors,
    optional_signature,
    optional_tensors,
    trained_tensors,
)
from esper.tolaria.stacked_norm import batch_norms, batch_norms_unfolded
from esper.tolaria.structure_copy import deepcopy_structure
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
    ) -> None:
        if len(envs) < MIN_GROUP or len(envs) != len(accs):
            raise ValueError(
                f"a stacked group needs at least {MIN_GROUP} envs and one accumulator each, "
                f"got {len(envs)} envs and {len(accs)} accumulators"
            )
        self.envs = list(envs)
        self.accs = list(accs)
        views = views or [EnvView.of(env) for env in self.envs]
        signatures = [optional_signature(env, view) for env, view in zip(envs, views, strict=True)]
        every = {name for signature in signatures for name in signature}
        #: The model that runs every member's forward: a member with every gate, seed
        #: blending in and seed in TRAINING that any member has, else one built for the
        #: group (:func:`_built_template`), whose own tensors no step touches.
        lead = next((g for g, sig in enumerate(signatures) if every <= sig.keys()), None)
        if lead is None:
            self.template, slot_owners = _built_template(self.envs, signatures)
            template_tensors = HostTensors.of(self.template)
        else:
            self.template = self.envs[lead].model
            slot_owners = {slot_id: self.envs[lead] for slot_id in self.template.slot_ids}
            template_tensors = views[lead].tensors
        template_named = template_tensors.named
        template_slots = template_tensors.slots
        names = {id(p): name for name, p in template_named[0].items()}
        #: Per env, the parameters and buffers its step uses, by name: the same names for
        #: every member, but for the optional ones it lacks (an idle seed's are left out,
        #: and with them the template's, whose own tensors the swap keeps but
        #: the forward does not run).
        optional = [optional_tensors(e.model, v.tensors) for e, v in zip(envs, views, strict=True)]
        trained = [
            trained_tensors(e.model, v.tensors, o)
            for e, v, o in zip(envs, views, optional, strict=True)
        ]
        self._params = [t[0] | o[0] for t, o in zip(trained, optional, strict=True)]
        self._buffers = [t[1] | o[1] for t, o in zip(trained, optional, strict=True)]
        #: Every stacked tensor by name, in the template's order, as a member holds it:
        #: what the stacked one is made like (dtype, device, whether it needs a gradient).
        self._like_params = _first_held(template_named[0], self._params)
        self._like_buffers = _first_held(template_named[1], self._buffers)
        unrun = (self._like_params.keys() - template_named[0].keys()) | (
            self._like_buffers.keys() - template_named[1].keys()
        )
        if unrun:
            raise ValueError(
                f"this group's template has no {sorted(unrun)} that its members train; "
                "group envs with stack_groups, which builds a template that has them"
            )
        #: Each stacked tensor's shape: the widest any member has, dimension by dimension
        #: (members whose layers merged different widenings: the others' rows zero-padded).
        self._shapes = {
            name: _widest([mine[name].shape for mine in tensors if name in mine])
            for tensors in (self._params, self._buffers)
            for name in {name for mine in tensors for name in mine}
        }
        padded = any(
            tensor.shape != self._shapes[name]
            for tensors in (self._params, self._buffers)
            for mine in tensors
            for name, tensor in mine.items()
        )
        if padded and not all(view.pad_safe for view in views):
            raise ValueError(
                "members of this group hold tensors of different sizes and not every member "
                "pads exactly (a residual seed, or a host without pads_widths_exactly); group "
                "envs with stack_groups, which keeps such envs apart"
            )
        #: The names some member lacks: their rows are zeros there, never written back.
        names_of = [
            params.keys() | buffers.keys()
            for params, buffers in zip(self._params, self._buffers, strict=True)
        ]
        self._optional = set.union(*names_of) - set.intersection(*names_of)
        #: The gates some member lacks, in the template's order: run as 1 on its row.
        self._partial_gates = [
            name for name in gate_tensors(self.template, template_tensors) if name in self._optional
        ]
        buffer_names = {id(b): name for name, b in template_named[1].items()}
        incubating = incubating_slots(self.template)

        def first_param(slot: SeedSlot) -> str | None:
            seed_params = template_slots[slot.slot_id].seed[0].values()
            return next((names[id(p)] for p in seed_params), None)

        def lacked(slots: Sequence[SeedSlot]) -> list[SeedSlot]:
            return [slot for slot in slots if first_param(slot) in self._optional]

        #: The template's slots in TRAINING whose seed some member lacks: their
        #: incubation is scaled (``SeedSlot.scale_incubation``).
        self._scaled = lacked(incubating)
        #: Per seed some member lacks, by the name of the buffer its slot scales it by (a
        #: seed blending in: its alpha, in both passes; in TRAINING: its incubation scale,
        #: in the incubation pass), the name of one of its parameters: the scale is run as
        #: 0 on the rows of the members without that parameter.
        #: The template's slots blending a seed in where some member's seed, the same one
        #: (:func:`optional_signature`), is in TRAINING: run for those members at alpha 0
        #: in the host's pass and 1 in the incubation pass, the only one they learn from.
        incubated = [{slot.slot_id for slot in incubating_slots(e.model)} for e in self.envs]

        def mixed_slot(slot: SeedSlot) -> _MixedSlot:
            seed_params, seed_buffers = template_slots[slot.slot_id].seed
            blending = [e.model.slot(slot.slot_id).stage in BLEND_STAGES for e in self.envs]
            return _MixedSlot(
                alpha=buffer_names[id(slot.alpha_tensor)],
                params=[names[id(p)] for p in seed_params.values()],
                buffers=[buffer_names[id(b)] for b in seed_buffers.values()],
                blending=blending,
                training=[slot.slot_id in ids for ids in incubated],
                keeps_alpha=any(b and ids for b, ids in zip(blending, incubated, strict=True)),
            )

        self._mixed = [
            mixed_slot(slot)
            for slot in blending_slots(self.template)
            if slot.seed is not None and any(slot.slot_id in ids for ids in incubated)
        ]
        mixed_alphas = {mixed.alpha for mixed in self._mixed}
        self._partial_alphas = {
            buffer_names[id(slot.alpha_tensor)]: first_param(slot)
            for slot in lacked(blending_slots(self.template))
            if buffer_names[id(slot.alpha_tensor)] not in mixed_alphas
        }
        self._partial_incubations = {
            buffer_names[id(slot.incubation_tensor)]: first_param(slot) for slot in self._scaled
        }
        settings: dict[str, tuple[float, float, float]] = {}  # members agree (stack_key)
        for mine, view in zip(self._params, views, strict=True):
            for name, p in mine.items():
                if id(p) in view.settings:
                    settings.setdefault(name, view.settings[id(p)])
        #: Parameter names by (lr, momentum, weight decay): one SGD group each.
        self._sgd_groups: dict[tuple[float, float, float], list[str]] = {}
        for name in self._like_params:
            if name in settings:
                self._sgd_groups.setdefault(settings[name], []).append(name)
        #: Per member, each parameter its step uses, with its optimizer, by name: where
        #: its momentum buffer lives. Only those: a member's idle seed can bear the name of
        #: the template's incubating one, and must get no state from its row.
        self._owners = [
            {name: owner for name, owner in _owners_by_name(e, v).items() if name in params}
            for e, v, params in zip(self.envs, views, self._params, strict=True)
        ]
        #: The slots whose seed the step trains: each member's own optimizer holds them.
        slot_ids = self.template.slot_ids
        trained_slots = [
            s
            for s, slot_id in enumerate(slot_ids)
            if slot_id in slot_owners[slot_id].seed_optimizers
            and self.template.slot(slot_id).stage not in IDLE_STAGES
        ]
        #: Their stacked parameters' names, slot by slot (a seed's, then its gate's).
        by_slot = [
            [
                names[id(p)]
                for p in template_slots[slot_ids[s]].seed_parameters()
                if names[id(p)] in self._like_params
            ]
            for s in trained_slots
        ]
        self._seed_names = [name for slot_names in by_slot for name in slot_names]
        #: Per member, where each slot's flags that it trains sit in its accumulator (which
        #: also lists an idle seed's parameters, and a gate the step does not run) and in
        #: ``_seed_names`` (which lists a gate the member lacks).
        self._flag_spans = [
            _flag_spans(acc, trained_slots, [len(n) for n in by_slot], set(_trained_slots(env)))
            for env, acc in zip(self.envs, self.accs, strict=True)
        ]
        self._incubating = incubating
        self._incubating_names = {
            names[id(p)]
            for slot in incubating
            for p in template_slots[slot.slot_id].seed_parameters()
        }
        #: What the incubation pass trains: the seeds in TRAINING, and a mixed slot's seed
        #: on its TRAINING rows, the others running it at alpha 0 there or, where one of
        #: them incubates a seed (``_MixedSlot.keeps_alpha``), masked by row.
        self._learning_names = self._incubating_names | {
            name for mixed in self._mixed for name in mixed.params
        }
        self._incubating_buffers = {
            buffer_names[id(b)]
            for slot in incubating
            for b in template_slots[slot.slot_id].seed[1].values()
        }
        #: The template's batch norms, run with the envs folded into channels
        #: (``esper.tolaria.stacked_norm``): one fused kernel each, as each env's own step.
        self._norms = batch_norms(self.template)
        self._forward = vmap(_forward(self.template), randomness="different")
        self._stacked: _Stacked | None = None

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
        autocast = autocast_to(x.device.type, autocast_dtype)
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
        if self._incubating or stacked.mixed:
            self._incubation_backward(stacked, x, y, autocast)
        self._update_grad_flags(stacked)
        sgd_step(stacked.optimizers)
        count = y[0].numel()
        loss = loss.detach()
        stacked.loss_sum.add_(loss * count)
        stacked.correct.add_(correct)
        stacked.loss_finite.logical_and_(finite(loss))
        stacked.seen += count
        stacked.last_batch = (x, y)

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
            name: p if name in self._learning_names else p.detach()
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
        incubating = seeds_incubating(self._incubating, self._scaled)
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
        if not self._seed_names:
            return
        norms = [
            stacked.no_grad
            if stacked.params[name].grad is None
            else stacked.params[name].grad.reshape(self.size, -1).norm(dim=1)
            for name in self._seed_names
        ]
        stacked.params_finite.logical_and_(finite(torch.stack(norms, dim=1)))

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
        shapes, copies = self._shapes, Copies()
        params = {
            name: _stacked_rows([mine.get(name) for mine in self._params], shapes[name], p, copies)
            for name, p in self._like_params.items()
        }
        buffers = {
            name: _stacked_rows([mine.get(name) for mine in self._buffers], shapes[name], b, copies)
            for name, b in self._like_buffers.items()
        }
        optimizers = []
        for (lr, momentum, decay), names in self._sgd_groups.items():
            leaves = [params[name] for name in names]
            optimizer = torch.optim.SGD(leaves, lr=lr, momentum=momentum, weight_decay=decay)
            for name, leaf in zip(names, leaves, strict=True):
                # A member without a buffer (its first step, or without the tensor) gets a
                # row of zeros: ``0 * momentum + grad`` is the gradient, as torch starts a
                # buffer. ``write_back`` gives a member that has the tensor its buffer.
                buffers_of = [
                    _momentum_of(*owners[name]) if name in owners else None
                    for owners in self._owners
                ]
                had = next((b for b in buffers_of if b is not None), None)
                if had is not None:
                    stacked_buffer = _stacked_rows(buffers_of, shapes[name], had, copies)
                    optimizer.state[leaf][MOMENTUM_BUFFER] = stacked_buffer
            optimizers.append(optimizer)
        copies.run()
        for name, p in self._like_params.items():
            params[name].requires_grad_(p.requires_grad)
        device = next(iter(params.values())).device

        def members_with(name: str, dims: int) -> Tensor:
            """``[G, 1, ...]`` bool (``dims`` dimensions), the members that have ``name``."""
            return rows_of([name in mine for mine in self._params], dims)

        made: dict[tuple[bool, ...], Tensor] = {}

        def rows_of(flags: Sequence[bool], dims: int) -> Tensor:
            """``[G, 1, ...]`` bool (``dims`` dimensions), true on the rows ``flags`` name:
            made on the device by fills (no list crosses to it), a fill per run of true
            rows, once per pattern (read-only views of it after)."""
            key = tuple(flags)
            if key not in made:
                rows = made[key] = torch.zeros(self.size, device=device, dtype=torch.bool)
                for start, stop in _runs(key):
                    rows[start:stop] = True
            return made[key].view(-1, *([1] * (dims - 1)))

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
            for slot in self._mixed
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
            if name not in self._incubating_buffers or name in kept_names
        }
        incubation_buffers = {
            name: b if name in self._incubating_buffers or name in kept_names else copied[name]
            for name, b in buffers.items()
        }
        return _Stacked(
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
                name: members_with(name, params[name].dim()) for name in self._partial_gates
            },
            alpha_masks={
                alpha: members_with(seed, buffers[alpha].dim())
                for alpha, seed in self._partial_alphas.items()
            },
            incubation_masks={
                scale: members_with(seed, buffers[scale].dim())
                for scale, seed in self._partial_incubations.items()
            },
            buffers_before=list(buffers_before.values()),
            optimizers=optimizers,
            loss_sum=torch.zeros(self.size, device=device),
            correct=torch.zeros(self.size, device=device, dtype=torch.long),
            loss_finite=torch.ones(self.size, device=device, dtype=torch.bool),
            params_finite=torch.ones(
                self.size, len(self._seed_names), device=device, dtype=torch.bool
            ),
            no_grad=torch.zeros(self.size, device=device),
        )

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the stacked tensors and sums into the members (a few multi-tensor ops:
        ``esper.tolaria.copies``); nothing is read on the host."""
        stacked, self._stacked = self._stacked, None
        if stacked is None:
            return
        copies = Copies()
        for tensors, members in ((stacked.params, self._params), (stacked.buffers, self._buffers)):
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
                for owners, row in zip(self._owners, buffer.unbind(), strict=True):
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
            for mine, span in self._flag_spans[g]:
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
class _MixedSlot:
    """A slot where the group's template blends a seed in and some member's seed, the same
    one, is in TRAINING: its seed's tensors by name, per member whether it blends the
    seed in and whether it incubates it (neither: it lacks the seed), and whether a member
    that blends it in incubates a seed (here or elsewhere): that member's incubation pass
    must see this seed at its alpha, as its own incubation does."""

    alpha: str
    params: list[str]
    buffers: list[str]
    blending: list[bool]
    training: list[bool]
    keeps_alpha: bool


@dataclass(frozen=True)
class _MixedRows:
    """A :class:`_MixedSlot`'s rows on the device, each mask ``[G, 1, ...]`` shaped for its
    tensor: the members blending the seed in (for its alpha in the host's pass), the
    TRAINING members as alpha (1 there, 0 elsewhere: the incubation pass's), and the
    TRAINING members for each seed buffer and, where the slot keeps the blending members'
    alpha in the incubation pass, for each seed parameter (only those rows learn there)."""

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
    #: Per slot of ``StackedGroup._mixed``, its rows.
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


def _trained_slots(env: GrowingHost) -> list[int]:
    """The indices of the slots whose seed a step of ``env`` trains (its own optimizer)."""
    return [
        s
        for s, slot_id in enumerate(env.slot_ids)
        if slot_id in env.seed_optimizers and env.model.slot(slot_id).stage not in IDLE_STAGES
    ]


def _flag_spans(
    acc: EnvAccumulator, slots: Sequence[int], stacked_sizes: Sequence[int], own: set[int]
) -> list[tuple[slice, slice]]:
    """For each of ``slots`` (in order) that is also in ``own`` (the member's trained
    slots), the span of its parameters' flags in ``acc`` and in a group's stacked flags,
    which list only ``slots``, ``stacked_sizes[k]`` for the k-th.

    A slot lists its seed's parameters, then its gate's, in both; where one of the two
    lists a gate the other does not (a member without the template's gate, a gate the
    step does not run), the seed's flags are the spans' common start."""
    spans = dict(acc.seed_spans)
    pairs, start = [], 0
    for s, stacked_size in zip(slots, stacked_sizes, strict=True):
        mine = spans.get(s)
        if mine is None or s not in own:  # a seed this member lacks, or leaves idle
            start += stacked_size
            continue
        size = min(mine.stop - mine.start, stacked_size)
        pairs.append((slice(mine.start, mine.start + size), slice(start, start + size)))
        start += stacked_size
    return pairs


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
    (``StackedGroup._mixed``) a member incubating the seed runs it at alpha 0 in the
    host's pass, as its own TRAINING slot passes the host's activation on, and at alpha 1
    in the incubation pass (and its seed's gate, which TRAINING does not run, as 1); the
    other members run it at their alpha in the host's pass and at 0 in the incubation
    pass, which so gives their seed rows exact zeros (they learn from the host's pass),
    unless one that blends it in incubates a seed (``_MixedSlot.keeps_alpha``): then at
    their alpha there too, and ``StackedGroup`` masks the seed's rows instead."""
    if stacked.gate_masks:
        params = params | {
            name: torch.where(has, params[name], _NO_GATE_LOGIT)
            for name, has in stacked.gate_masks.items()
        }
    masks = stacked.alpha_masks | (stacked.incubation_masks if incubating else {})
    if masks:
        buffers = buffers | {
            name: torch.where(has, buffers[name], 0.0) for name, has in masks.items()
        }
    if stacked.mixed:  # a seed some members blend in and others incubate
        buffers = buffers | {
            mixed.alpha: (
                torch.where(mixed.blending, buffers[mixed.alpha], mixed.training_alpha)
                if mixed.keeps_alpha
                else mixed.training_alpha
            )
            if incubating
            else torch.where(mixed.blending, buffers[mixed.alpha], 0.0)
            for mixed in stacked.mixed
        }
    return params, buffers


def _on_rows(rows: Tensor, grad: Tensor) -> Tensor:
    """``grad`` on ``rows`` (``[G, 1, ...]`` bool), exact zeros on the others."""
    return torch.where(rows, grad, 0.0)


def _owners_by_name(
    env: GrowingHost, view: EnvView
) -> dict[str, tuple[torch.optim.Optimizer, Tensor]]:
    """Each parameter's optimizer, and the parameter, by its name in the host."""
    owners: dict[int, torch.optim.Optimizer] = {}
    for optimizer in env.optimizers():
        for group in optimizer.param_groups:
            for p in group["params"]:
                owners[id(p)] = optimizer
    named = view.tensors.named[0]
    return {name: (owners[id(p)], p) for name, p in named.items() if id(p) in owners}


def _momentum_of(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor | None:
    """``param``'s momentum buffer, read without adding an empty state for it (an
    optimizer's state is a defaultdict, and what it holds goes into checkpoints)."""
    state = optimizer.state.get(param)
    return None if state is None else state.get(MOMENTUM_BUFFER)


def _first_held(order: dict[str, Tensor], held: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Each name any of ``held`` has, in ``order``'s order, with the first one's tensor."""
    first: dict[str, Tensor] = {}
    for mine in held:
        for name, tensor in mine.items():
            first.setdefault(name, tensor)
    return {name: first[name] for name in (*order, *first) if name in first}


def _built_template(
    envs: Sequence[GrowingHost], signatures: Sequence[dict[str, Hashable]]
) -> tuple[HostModel, dict[str, GrowingHost]]:
    """A host that runs every seed a group's members run, where no member does (one blends
    a seed in at one slot, another at another), and the member each slot came from.

    A copy of the member with the most entries of :func:`optional_signature`, each slot
    taken from the member that runs the most there: one blending a seed in before one
    incubating it, one whose gate the forward runs before one without (a fossilized seed
    with a gate beside one without shares a key). The forward runs each seed as the
    member it came from would. Its own tensors are uninitialised (:func:`_placeholders`):
    the group's stacked tensors are swapped in, and the forward runs no other."""
    base = max(range(len(envs)), key=lambda g: (len(signatures[g]), -g))
    template = deepcopy_structure(envs[base].model, _placeholders(envs[base].model))
    owners = {slot_id: envs[base] for slot_id in template.slot_ids}
    for slot_id in template.slot_ids:
        running = [
            (slot.stage in BLEND_STAGES, slot.gate is not None and slot.stage in GATE_STAGES, -g)
            for g, env in enumerate(envs)
            if (slot := env.model.slot(slot_id)).seed is not None and slot.stage not in IDLE_STAGES
        ]
        if not running:
            continue
        donor = -max(running)[2]
        if donor != base:
            slot = envs[donor].model.slot(slot_id)
            template.slots[slot_id] = deepcopy_structure(slot, _placeholders(slot))
            owners[slot_id] = envs[donor]
    return template, owners


def _placeholders(module: nn.Module) -> dict[int, object]:
    """A ``copy.deepcopy`` memo that gives each parameter and buffer of ``module`` an
    uninitialised tensor of its shape, dtype and device instead of a copy of its values: a
    built template's own tensors are never read, and copying them cost a kernel each."""
    memo: dict[int, object] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b)
    return memo


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each run of true entries of ``flags``."""
    runs: list[tuple[int, int]] = []
    for g, flag in enumerate(flags):
        if not flag:
            continue
        if runs and runs[-1][1] == g:
            runs[-1] = (runs[-1][0], g + 1)
        else:
            runs.append((g, g + 1))
    return runs


def _widest(shapes: Sequence[torch.Size]) -> torch.Size:
    """The smallest shape that holds each of ``shapes`` (all with as many dimensions)."""
    return torch.Size(max(sizes) for sizes in zip(*shapes, strict=True))


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
