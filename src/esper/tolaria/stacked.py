"""Training the hosts of several envs as one stacked network (``HostTraining.engine="stacked"``).

Why: a host of the predecessor's size is a few dozen small kernels a training step, so on
a GPU the per-env path is launch-bound, and adding envs adds launches, not work. Envs
whose hosts have the same architecture, the same seeds in the same stages and the same
optimizer settings differ only in their tensors, so their steps can run as one: every
parameter, buffer and momentum buffer stacked along a leading env dimension, the forward
mapped over it with ``torch.func.vmap`` (one grouped kernel where the per-env path
launched one per env), one backward, one SGD step over the stacked tensors. A seed just
planted counts as no seed: no pass of the step runs it.

A group is formed at the start of an epoch and written back into its envs at the end,
before validation: lifecycle ops, rollback, checkpoints and the counterfactual pass run
between epochs on the envs' own tensors, as before. Within an epoch nothing changes which
parameters exist, so the grouping holds. What cannot be stacked trains on the per-env
path: an env alone in its group, a batch whose shares differ in size (the group is written
back first), and a group that ran out of memory (its envs finish the epoch alone).

Results equal the per-env path's up to float rounding: the elementwise work (SGD, batch
norm statistics, the blend) is the same arithmetic, while a stacked convolution or matrix
product sums in another order. ``tests/tolaria/test_stacked.py`` states and checks the
tolerance. A stacked forward runs the group's first host as the template with the
group's tensors swapped in (``torch.func.functional_call``), so everything that steers
the forward in Python (seed types and blueprints, what a stage does, gates) is part of
the group's key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.func import functional_call, vmap

from esper.contracts import SeedStage
from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import incubating_slots, seeds_incubating
from esper.kasmina.sgd import MOMENTUM_BUFFER, sgd_step
from esper.kasmina.slot import SeedSlot
from esper.tolaria.accumulators import EnvAccumulator
from esper.tolaria.host_training import autocast_to

#: The fewest envs worth stacking: one env alone gains nothing over its own path.
MIN_GROUP = 2


# ----------------------------------------------------------------------------- grouping
def stack_key(env: GrowingHost) -> Hashable:
    """What must be equal for envs to train as one stacked network.

    The host's class, device and mode; the name, shape and dtype of every parameter and
    buffer a training step uses (:func:`trained_tensors`); what steers each slot's
    forward (:func:`_slot_key`); and, per parameter, the optimizer settings and whether
    it has a momentum buffer yet. Alpha is not in it: it is a buffer, stacked like the
    others, so envs blending at different points of their ramps, or by different blend
    modes, share a group. Nor is a seed that the step leaves alone (:data:`IDLE_STAGES`):
    an env that has just planted one trains with the envs whose slot is empty.
    """
    model = env.model
    settings = _optimizer_settings(env)
    params, buffers = trained_tensors(model)
    params_key = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad, settings.get(id(p)))
        for name, p in params.items()
    )
    buffers_key = tuple((name, tuple(b.shape), b.dtype) for name, b in buffers.items())
    slots = tuple(_slot_key(slot) for slot in model.iter_slots())
    return (type(model), env.device, model.training, params_key, buffers_key, slots)


#: Stages whose seed a training step leaves alone: its slot passes the host's activation
#: on, no pass of the step runs the seed, so its parameters get no gradient and its
#: optimizer skips them (GERMINATED: planted, incubating from the next epoch).
IDLE_STAGES = frozenset({SeedStage.GERMINATED})


def trained_tensors(model: HostModel) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The parameters and buffers, by name, that a training step of ``model`` uses: all
    but those of seeds (and their gates) in :data:`IDLE_STAGES`."""
    idle: set[int] = set()
    for slot in model.iter_slots():
        if slot.seed is not None and slot.stage in IDLE_STAGES:
            for module in (slot.seed, slot.gate):
                if module is not None:
                    idle.update(id(t) for t in module.parameters())
                    idle.update(id(t) for t in module.buffers())
    params = {name: p for name, p in model.named_parameters() if id(p) not in idle}
    buffers = {name: b for name, b in model.named_buffers() if id(b) not in idle}
    return params, buffers


#: What a slot's stage makes its forward do with a seed (``SeedSlot.forward``): pass the
#: host through, add the seed on a detached input at alpha, or add it as part of the host.
_FORWARD_BY_STAGE = {
    SeedStage.GERMINATED: "through",
    SeedStage.TRAINING: "through, incubates",
    SeedStage.BLENDING: "blends",
    SeedStage.HOLDING: "blends",
    SeedStage.FOSSILIZED: "part of the host",
}


def _slot_key(slot: SeedSlot) -> Hashable:
    """What steers a slot's forward in Python: nothing without a seed or with an idle one
    (an empty slot, a merged widening and a seed in :data:`IDLE_STAGES` pass ``h`` on);
    else the seed's module type and blueprint, what its stage makes the forward do, and
    whether a gate multiplies it."""
    if slot.seed is None or slot.stage in IDLE_STAGES:
        return (slot.slot_id,)
    return (
        slot.slot_id,
        type(slot.seed),
        slot.lifecycle.blueprint,
        _FORWARD_BY_STAGE.get(slot.stage, slot.stage),
        slot.gate is not None,
    )


def stack_groups(envs: Sequence[GrowingHost]) -> tuple[list[list[int]], list[int]]:
    """Envs that can train stacked, as groups of at least :data:`MIN_GROUP` env indices
    (in env order), and the indices of the envs left to train alone."""
    by_key: dict[Hashable, list[int]] = {}
    for i, env in enumerate(envs):
        by_key.setdefault(stack_key(env), []).append(i)
    groups = [members for members in by_key.values() if len(members) >= MIN_GROUP]
    grouped = {i for members in groups for i in members}
    return groups, [i for i in range(len(envs)) if i not in grouped]


def _optimizer_settings(env: GrowingHost) -> dict[int, tuple[float, float, float, bool]]:
    """Per parameter (by id): learning rate, momentum, weight decay, has a momentum buffer."""
    settings: dict[int, tuple[float, float, float, bool]] = {}
    for optimizer in env.optimizers():
        for group in optimizer.param_groups:
            for p in group["params"]:
                has_buffer = _momentum_of(optimizer, p) is not None
                settings[id(p)] = (
                    group["lr"],
                    group["momentum"],
                    group["weight_decay"],
                    has_buffer,
                )
    return settings


# ----------------------------------------------------------------------------- the group
class StackedGroup:
    """Envs of one :func:`stack_key` training as one network for an epoch.

    ``step`` takes each member's share of a batch stacked ``[G, b, ...]``; ``write_back``
    puts parameters, buffers, momentum and the epoch's sums into the members (their
    :class:`EnvAccumulator` s) and may be called at any point: the next ``step`` stacks
    the members afresh.
    """

    def __init__(self, envs: Sequence[GrowingHost], accs: Sequence[EnvAccumulator]) -> None:
        if len(envs) < MIN_GROUP or len(envs) != len(accs):
            raise ValueError(
                f"a stacked group needs at least {MIN_GROUP} envs and one accumulator each, "
                f"got {len(envs)} envs and {len(accs)} accumulators"
            )
        self.envs = list(envs)
        self.accs = list(accs)
        leader = self.envs[0]
        self.template = leader.model
        names = {id(p): name for name, p in self.template.named_parameters()}
        #: Per env, the parameters and buffers its step uses, by name (the same names for
        #: every member: an idle seed's are left out, and with them the template's, whose
        #: own tensors ``functional_call`` keeps but the forward does not run).
        trained = [trained_tensors(env.model) for env in self.envs]
        self._params = [params for params, _ in trained]
        self._buffers = [buffers for _, buffers in trained]
        settings = _optimizer_settings(leader)
        #: Parameter names by (lr, momentum, weight decay): one SGD group each.
        self._sgd_groups: dict[tuple[float, float, float], list[str]] = {}
        for name, p in self._params[0].items():
            if id(p) in settings:
                lr, momentum, decay, _ = settings[id(p)]
                self._sgd_groups.setdefault((lr, momentum, decay), []).append(name)
        #: Per member, each parameter's optimizer and the parameter, by name: where its
        #: momentum buffer lives.
        self._owners = [_owners_by_name(env) for env in self.envs]
        #: The slots whose seed the step trains: each member's own optimizer holds them.
        trained_slots = [
            s
            for s, slot_id in enumerate(leader.slot_ids)
            if slot_id in leader.seed_optimizers
            and leader.model.slot(slot_id).stage not in IDLE_STAGES
        ]
        #: Their parameters' names, slot by slot.
        self._seed_names = [
            names[id(p)]
            for s in trained_slots
            for p in leader.model.slot(leader.slot_ids[s]).seed_parameters()
        ]
        #: Per member, where each trained slot's flags sit in its accumulator (which also
        #: lists an idle seed's parameters) and in ``_seed_names``.
        self._flag_spans = [_flag_spans(acc, trained_slots) for acc in self.accs]
        incubating = incubating_slots(self.template)
        self._incubating = incubating
        incubating_ids = {id(p) for slot in incubating for p in slot.seed_parameters()}
        self._incubating_names = {
            names[id(p)] for p in self.template.parameters() if id(p) in incubating_ids
        }
        seed_buffer_ids = {
            id(b) for slot in incubating if slot.seed is not None for b in slot.seed.buffers()
        }
        self._incubating_buffers = {
            name for name, b in self.template.named_buffers() if id(b) in seed_buffer_ids
        }
        self._forward = vmap(_forward_loss(self.template), randomness="different")
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
        with self.template.mapped(), autocast:
            loss, correct = self._forward(stacked.params, stacked.buffers, x, y)
        loss.sum().backward()
        if self._incubating:
            self._incubation_backward(stacked, x, y, autocast)
        self._update_grad_flags(stacked)
        sgd_step(stacked.optimizers)
        count = y[0].numel()
        loss = loss.detach()
        stacked.loss_sum.add_(loss * count)
        stacked.correct.add_(correct)
        stacked.loss_finite.logical_and_(torch.isfinite(loss))
        stacked.seen += count
        stacked.last_batch = (x, y)

    def _incubation_backward(
        self, stacked: _Stacked, x: Tensor, y: Tensor, autocast: AbstractContextManager
    ) -> None:
        """The seed-only pass of the members' seeds in TRAINING (``esper.kasmina.incubation``):
        host parameters out of autograd, host buffers on copies, seeds at alpha 1."""
        params = {
            name: p if name in self._incubating_names else p.detach()
            for name, p in stacked.params.items()
        }
        buffers = {
            name: b if name in self._incubating_buffers else b.clone()
            for name, b in stacked.buffers.items()
        }
        with self.template.mapped(), seeds_incubating(self._incubating), autocast:
            seed_loss, _ = self._forward(params, buffers, x, y)
        seed_loss.sum().backward()

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
        stacked.params_finite.logical_and_(torch.isfinite(torch.stack(norms, dim=1)))

    # ------------------------------------------------------------------ stacking
    def _stack(self) -> _Stacked:
        """Every member's tensors stacked along a new first dimension (copies)."""
        with torch.no_grad():
            params = {
                name: torch.stack([mine[name] for mine in self._params]).requires_grad_(
                    self._params[0][name].requires_grad
                )
                for name in self._params[0]
            }
            buffers = {
                name: torch.stack([mine[name] for mine in self._buffers])
                for name in self._buffers[0]
            }
        optimizers = []
        for (lr, momentum, decay), names in self._sgd_groups.items():
            leaves = [params[name] for name in names]
            optimizer = torch.optim.SGD(leaves, lr=lr, momentum=momentum, weight_decay=decay)
            for name, leaf in zip(names, leaves, strict=True):
                buffers_of = [_momentum_of(*owners[name]) for owners in self._owners]
                if buffers_of[0] is not None:
                    optimizer.state[leaf][MOMENTUM_BUFFER] = torch.stack(buffers_of)
            optimizers.append(optimizer)
        device = next(iter(params.values())).device
        return _Stacked(
            params=params,
            buffers=buffers,
            buffers_before=[b.clone() for b in buffers.values()],
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
        """Copy the stacked tensors and sums into the members; nothing is read on the host."""
        stacked, self._stacked = self._stacked, None
        if stacked is None:
            return
        for name, p in stacked.params.items():
            torch._foreach_copy_([mine[name] for mine in self._params], list(p.detach().unbind()))
        for name, b in stacked.buffers.items():
            torch._foreach_copy_([mine[name] for mine in self._buffers], list(b.unbind()))
        leaves = {id(p): name for name, p in stacked.params.items()}
        for optimizer in stacked.optimizers:
            for leaf, state in optimizer.state.items():
                buffer = state.get(MOMENTUM_BUFFER)
                if buffer is None:
                    continue
                name = leaves[id(leaf)]
                for owners, row in zip(self._owners, buffer.unbind(), strict=True):
                    owner, param = owners[name]
                    mine = _momentum_of(owner, param)
                    if mine is None:  # its first step was a stacked one
                        owner.state[param][MOMENTUM_BUFFER] = row.clone()
                    else:
                        mine.copy_(row)
        for g, (env, acc) in enumerate(zip(self.envs, self.accs, strict=True)):
            acc.loss_sum.add_(stacked.loss_sum[g])
            acc.correct.add_(stacked.correct[g])
            acc.loss_finite.logical_and_(stacked.loss_finite[g])
            for mine, ours in self._flag_spans[g]:
                acc.params_finite[mine].logical_and_(stacked.params_finite[g, ours])
            acc.seen += stacked.seen
            acc.seen_stacked += stacked.seen
            env.zero_grad()
            if stacked.last_batch is not None:
                x, y = stacked.last_batch
                env.probe = (x[g], y[g])


@dataclass
class _Stacked:
    """A group's tensors while it trains stacked (``[G, ...]`` each), and its running sums."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    #: ``buffers`` as the running step found them (in their order).
    buffers_before: list[Tensor]
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


def _flag_spans(acc: EnvAccumulator, slots: Sequence[int]) -> list[tuple[slice, slice]]:
    """For each of ``slots`` (in order), the span of its parameters' flags in ``acc`` and in
    a group's stacked flags, which list only ``slots``."""
    spans = dict(acc.seed_spans)
    pairs, start = [], 0
    for s in slots:
        mine = spans[s]
        size = mine.stop - mine.start
        pairs.append((mine, slice(start, start + size)))
        start += size
    return pairs


def _owners_by_name(env: GrowingHost) -> dict[str, tuple[torch.optim.Optimizer, Tensor]]:
    """Each parameter's optimizer, and the parameter, by its name in the host."""
    owners: dict[int, torch.optim.Optimizer] = {}
    for optimizer in env.optimizers():
        for group in optimizer.param_groups:
            for p in group["params"]:
                owners[id(p)] = optimizer
    return {name: (owners[id(p)], p) for name, p in env.model.named_parameters() if id(p) in owners}


def _momentum_of(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor | None:
    """``param``'s momentum buffer, read without adding an empty state for it (an
    optimizer's state is a defaultdict, and what it holds goes into checkpoints)."""
    state = optimizer.state.get(param)
    return None if state is None else state.get(MOMENTUM_BUFFER)


def _forward_loss(template: HostModel) -> Callable[..., tuple[Tensor, Tensor]]:
    """One member's forward and loss, with its tensors swapped into the template."""

    def forward_loss(
        params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor, y: Tensor
    ) -> tuple[Tensor, Tensor]:
        outputs = functional_call(template, (params, buffers), (x,))
        loss, correct, _ = template.loss_and_correct(outputs, y)
        return loss, correct

    return forward_loss
