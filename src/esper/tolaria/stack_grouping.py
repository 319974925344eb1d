"""Which envs can train as one stacked group (``esper.tolaria.stacked``), read once an epoch.

Envs stack where what steers their step in Python agrees (:func:`stack_key`: the host's
class, device and mode, every trained tensor's name, dtype and shape or, where a group
may zero-pad it, its number of dimensions, what steers each slot's forward, the optimizer
settings), and, among those, where the tensors some members lack agree wherever members
have them (:func:`optional_signature`: gates, seeds blending in or in TRAINING) and
differing sizes pad exactly (:func:`pads_exactly`). :func:`stack_groups` splits envs into
such groups greedily; the group's own module builds, steps and validates them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from esper.contracts import SeedStage
from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import incubating_slots
from esper.kasmina.slot import SeedSlot
from esper.kasmina.widening import Widening
from esper.tolaria.host_tensors import HostTensors, Named

#: The fewest envs worth stacking: one env alone gains nothing over its own path.
MIN_GROUP = 2


@dataclass(frozen=True)
class EnvView:
    """One env's tensors by name and optimizer settings, read once: grouping and a group's
    set-up consult them several times, and walking a host's module tree (what
    ``named_parameters`` does) cost more than everything else they do (16 envs, default
    fit: 17 ms an epoch with a walk per lookup, 7 ms with one per env)."""

    tensors: HostTensors
    #: Per parameter (by id): :func:`_optimizer_settings`.
    settings: dict[int, tuple[float, float, float]]
    #: The tensors (by id) a group may zero-pad: :func:`paddable_tensors`.
    paddable: frozenset[int] = frozenset()
    #: Whether the env may train with members of other widths: :func:`pads_exactly`.
    pad_safe: bool = False

    @classmethod
    def of(cls, env: GrowingHost) -> EnvView:
        return cls(
            HostTensors.of(env.model),
            _optimizer_settings(env),
            paddable_tensors(env.model),
            pads_exactly(env.model),
        )


def stack_key(env: GrowingHost, view: EnvView | None = None) -> Hashable:
    """What must be equal for envs to train as one stacked network.

    The host's class, device and mode; the name, shape and dtype of every parameter and
    buffer a training step uses (:func:`trained_tensors`); what steers each slot's
    forward (:func:`_slot_key`); and, per parameter, the optimizer settings. Not whether
    it has a momentum buffer yet: a member without one runs a row of zeros, and
    ``0 * momentum + grad`` is its first step's buffer exactly, as torch starts it (a copy
    of the gradient). Alpha is not in it: it is a buffer, stacked like the
    others, so envs blending at different points of their ramps, or by different blend
    modes, share a group. Nor is a seed that the step leaves alone (:data:`IDLE_STAGES`):
    an env that has just planted one trains with the envs whose slot is empty. Nor are
    the tensors that members of a group need not all have (:func:`optional_tensors`: a
    seed's gate, a seed blending in or in TRAINING): envs with and without them share a
    group where :func:`stack_groups` finds them compatible. Nor the size of a tensor a
    group may pad (:func:`paddable_tensors`, its number of dimensions is): envs whose
    layers merged different widenings share a group where :func:`stack_groups` finds
    their sizes compatible.
    """
    model = env.model
    view = view or EnvView.of(env)
    settings = view.settings
    params, buffers = trained_tensors(model, view.tensors)
    params_key = tuple(
        (name, _size(p, view), p.dtype, p.requires_grad, settings.get(id(p)))
        for name, p in params.items()
    )
    buffers_key = tuple((name, _size(b, view), b.dtype) for name, b in buffers.items())
    slots = tuple(_slot_key(slot) for slot in model.iter_slots())
    return (type(model), env.device, model.training, params_key, buffers_key, slots)


#: Stages whose seed a training step leaves alone: its slot passes the host's activation
#: on, no pass of the step runs the seed, so its parameters get no gradient and its
#: optimizer skips them (GERMINATED: planted, incubating from the next epoch).
IDLE_STAGES = frozenset({SeedStage.GERMINATED})

#: Stages in which a slot's forward multiplies its seed's output by the seed's gate, where
#: it has one (``BlendMode.GATED``); a group whose members differ in having one runs every
#: member through it, a member without one as if its gate were 1.
GATE_STAGES = frozenset({SeedStage.BLENDING, SeedStage.HOLDING, SeedStage.FOSSILIZED})

#: Stages in which a slot adds its seed at alpha on a detached input (``SeedSlot.forward``):
#: a group whose members differ in having one there runs every member through it, a
#: member without one at an alpha of 0, which adds exactly nothing to its host.
BLEND_STAGES = frozenset({SeedStage.BLENDING, SeedStage.HOLDING})


def trained_tensors(
    model: HostModel, tensors: HostTensors | None = None, optional: Named | None = None
) -> Named:
    """The parameters and buffers, by name, that a training step of ``model`` uses and a
    group's members all have: all but those no pass of the step runs (seeds and their
    gates in :data:`IDLE_STAGES`; the gate of a seed in TRAINING, which its incubation
    runs at full strength, ungated) and those of :func:`optional_tensors` (``optional``,
    where the caller has them). ``tensors``: the host's, where the caller has read them."""
    tensors = tensors or HostTensors.of(model)
    optional_params, optional_buffers = optional or optional_tensors(model, tensors)
    left_out = {id(t) for t in (*optional_params.values(), *optional_buffers.values())}
    for slot in model.iter_slots():
        if slot.seed is None:
            continue
        mine = tensors.slots[slot.slot_id]
        if slot.stage in IDLE_STAGES:
            left_out.update(mine.ids(mine.seed, mine.gate))
        elif slot.stage is SeedStage.TRAINING:
            left_out.update(mine.ids(mine.gate))
    named = tensors.named
    params = {name: p for name, p in named[0].items() if id(p) not in left_out}
    buffers = {name: b for name, b in named[1].items() if id(b) not in left_out}
    return params, buffers


def optional_tensors(model: HostModel, tensors: HostTensors | None = None) -> Named:
    """The parameters and buffers, by name, that a group's members need not all have: the
    gates of :func:`gate_tensors` (a member without one runs the template's as 1), the
    seeds blending in (:func:`blending_slots`: a member without one runs the template's
    at alpha 0), and the seeds in TRAINING (not their gates: no pass runs those). The
    host's pass goes through a seed in TRAINING; only the incubation pass runs it, for
    every member of the group, scaled by 0 on the rows of a member without it.
    ``tensors``: the host's, where the caller has read them."""
    tensors = tensors or HostTensors.of(model)
    named = tensors.named
    params = {id(p) for p in gate_tensors(model, tensors).values()}
    buffers: set[int] = set()
    for slot in (*blending_slots(model), *incubating_slots(model)):
        seed_params, seed_buffers = tensors.slots[slot.slot_id].seed
        params.update(id(p) for p in seed_params.values())
        buffers.update(id(b) for b in seed_buffers.values())
    return (
        {name: p for name, p in named[0].items() if id(p) in params},
        {name: b for name, b in named[1].items() if id(b) in buffers},
    )


def blending_slots(model: HostModel) -> list[SeedSlot]:
    """The host's slots whose seed is in :data:`BLEND_STAGES`."""
    return [
        slot for slot in model.iter_slots() if slot.seed is not None and slot.stage in BLEND_STAGES
    ]


def gate_tensors(model: HostModel, tensors: HostTensors | None = None) -> dict[str, Tensor]:
    """The parameters, by name, of the gates the forward multiplies by (a seed in
    :data:`GATE_STAGES` that has one): a group's members need not all have them.
    ``tensors``: the host's, where the caller has read them."""
    tensors = tensors or HostTensors.of(model)
    gates = {
        id(p)
        for slot in model.iter_slots()
        if slot.seed is not None and slot.gate is not None and slot.stage in GATE_STAGES
        for p in tensors.slots[slot.slot_id].gate[0].values()
    }
    return {name: p for name, p in tensors.named[0].items() if id(p) in gates}


#: Stages whose seed leaves a slot's key (:func:`_slot_key`): the step does not run it, or
#: a group runs it for the members that lack it.
_NOT_IN_KEY = IDLE_STAGES | {SeedStage.TRAINING} | BLEND_STAGES


def _slot_key(slot: SeedSlot) -> Hashable:
    """What steers a slot's forward in Python: nothing where the host's pass goes through
    it (an empty slot, a merged widening, a seed in :data:`IDLE_STAGES`) or where a group
    runs the seed for members that lack it (in TRAINING or :data:`BLEND_STAGES`, which
    :func:`optional_signature` covers); else the seed's module type and blueprint, its
    stage, and, outside :data:`GATE_STAGES` (where a group runs a missing gate as 1),
    whether it has a gate."""
    if slot.seed is None or slot.stage in _NOT_IN_KEY:
        return (slot.slot_id,)
    gated = None if slot.stage in GATE_STAGES else slot.gate is not None
    return (slot.slot_id, type(slot.seed), slot.lifecycle.blueprint, slot.stage, gated)


#: Layers whose tensors a group may zero-pad to its widest member's size: a zero-padded
#: output channel or unit comes out zero (and, in training-mode batch norm, normalises to
#: zero), a zero-padded input channel adds nothing, and every padded entry's gradient is
#: zero, so it stays zero through SGD (weight decay and momentum included). A grouped
#: convolution mixes its channels by group index: not padded.
PADDABLE_LAYERS: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)


def paddable_tensors(model: HostModel) -> frozenset[int]:
    """The parameters and buffers (by id) of ``model``'s :data:`PADDABLE_LAYERS`, where
    its forward is exact on zero-padded layers (``HostModel.pads_widths_exactly``); none
    elsewhere."""
    if not model.pads_widths_exactly:
        return frozenset()
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, PADDABLE_LAYERS) and getattr(module, "groups", 1) == 1:
            ids.update(id(p) for p in module.parameters(recurse=False))
            ids.update(id(b) for b in module.buffers(recurse=False))
    return frozenset(ids)


def pads_exactly(model: HostModel) -> bool:
    """Whether ``model`` may train padded to wider members: its host's forward is exact on
    zero-padded layers and every seed a step runs is a widening (whose new channels the
    host's layers pad like their own). A residual seed adds its output to the activation
    of its slot, whose width it must then match in every member: where one runs, a group
    keeps every size equal."""
    return model.pads_widths_exactly and all(
        isinstance(slot.seed, Widening)
        for slot in model.iter_slots()
        if slot.seed is not None and slot.stage not in IDLE_STAGES
    )


def _size(tensor: Tensor, view: EnvView) -> Hashable:
    """A tensor's size in a grouping key: its number of dimensions where a group may pad
    it (:func:`paddable_tensors`), else its shape."""
    return tensor.dim() if id(tensor) in view.paddable else tuple(tensor.shape)


def _padded_sizes(env: GrowingHost, view: EnvView) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a step of ``env`` uses that a group may pad, by name."""
    optional = optional_tensors(env.model, view.tensors)
    trained = trained_tensors(env.model, view.tensors, optional)
    return {
        name: tuple(t.shape)
        for part in (trained, optional)
        for tensors in part
        for name, t in tensors.items()
        if id(t) in view.paddable
    }


def _sizes_agree(a: dict[str, tuple[int, ...]], b: dict[str, tuple[int, ...]]) -> bool:
    return all(shape == b[name] for name, shape in a.items() if name in b)


def stack_groups(
    envs: Sequence[GrowingHost], views: Sequence[EnvView] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Envs that can train stacked, as groups of at least :data:`MIN_GROUP` env indices
    (in env order), and the indices of the envs left to train alone. ``views``: each
    env's :class:`EnvView`, if the caller has them."""
    views = views or [EnvView.of(env) for env in envs]
    by_key: dict[Hashable, list[int]] = {}
    for i, env in enumerate(envs):
        by_key.setdefault(stack_key(env, views[i]), []).append(i)
    groups = [
        part
        for members in by_key.values()
        for part in _split_by_optional(
            members,
            [optional_signature(envs[i], views[i]) for i in members],
            [(_padded_sizes(envs[i], views[i]), views[i].pad_safe) for i in members],
        )
        if len(part) >= MIN_GROUP
    ]
    grouped = {i for members in groups for i in members}
    return groups, [i for i in range(len(envs)) if i not in grouped]


#: The entry :func:`optional_signature` adds, beside a slot's seed, where it blends in.
BLENDS = "blends"


def optional_signature(env: GrowingHost, view: EnvView | None = None) -> dict[str, Hashable]:
    """What members of a group that have an optional tensor must share: per gate of
    :func:`gate_tensors`, by name, its shape, dtype and optimizer settings; per slot with
    a seed blending in or in TRAINING, by slot, the seed's type, blueprint and tensors the
    same way; and per slot whose seed blends in, an entry ``"<slot>:blends"``. A group's
    template has every entry any member has, so where some member blends its seed in,
    the template does: its forward runs the seed for every member, and a member whose
    seed there is in TRAINING trains with it (``esper.tolaria.stacked.StackedGroup``:
    alpha 0 in the host's pass, 1 in the incubation pass)."""
    view = view or EnvView.of(env)
    settings = view.settings

    def param(p: Tensor) -> Hashable:
        return (_size(p, view), p.dtype, p.requires_grad, settings.get(id(p)))

    def seed(slot: SeedSlot) -> Hashable:
        params, buffers = view.tensors.slots[slot.slot_id].seed
        return (
            type(slot.seed),
            slot.lifecycle.blueprint,
            tuple((name, param(p)) for name, p in params.items()),
            tuple((name, _size(b, view), b.dtype) for name, b in buffers.items()),
        )

    gates = gate_tensors(env.model, view.tensors)
    signature: dict[str, Hashable] = {name: param(p) for name, p in gates.items()}
    for slot in blending_slots(env.model):
        signature[slot.slot_id] = seed(slot)
        signature[f"{slot.slot_id}:{BLENDS}"] = BLENDS
    for slot in incubating_slots(env.model):
        signature[slot.slot_id] = seed(slot)
    return signature


#: Per member of a key group: :func:`_padded_sizes`, and whether it pads exactly.
Sizes = tuple[dict[str, tuple[int, ...]], bool]


def _split_by_optional(
    members: list[int], signatures: list[dict[str, Hashable]], sizes: list[Sizes] | None = None
) -> list[list[int]]:
    """Envs of one :func:`stack_key` in parts that can train as one: in a part, the members
    that have an entry of :func:`optional_signature` agree on it (the group's template
    runs every entry any member has: a member with them all, or a host built for the
    group, ``esper.tolaria.stacked``); and members whose ``sizes`` differ both pad exactly
    (:func:`pads_exactly`; None: every size agrees).

    Greedy, twice: in env order, and with the members that have the most entries first;
    whichever leaves fewer envs alone (env order on a tie). Each part in env order."""
    by_entries = sorted(range(len(members)), key=lambda k: (-len(signatures[k]), k))
    sizes = sizes or [({}, True)] * len(members)
    tries = [_greedy_parts(members, signatures, sizes, order) for order in (None, by_entries)]
    return max(tries, key=lambda parts: sum(len(p) for p in parts if len(p) >= MIN_GROUP))


def _greedy_parts(
    members: list[int],
    signatures: list[dict[str, Hashable]],
    sizes: list[Sizes],
    order: list[int] | None,
) -> list[list[int]]:
    """:func:`_split_by_optional`'s parts, each member (taken in ``order`` of positions,
    default as listed) joining the first part it can."""
    parts: list[tuple[list[int], list[dict[str, Hashable]], list[Sizes]]] = []
    for k in range(len(members)) if order is None else order:
        i, mine, (my_sizes, my_safety) = members[k], signatures[k], sizes[k]
        for indices, theirs, their_sizes in parts:
            if any(
                not (my_safety and safe) and not _sizes_agree(my_sizes, other)
                for other, safe in their_sizes
            ):
                continue
            union = {name: s for sig in theirs for name, s in sig.items()}
            if any(union.get(name, s) != s for name, s in mine.items()):
                continue
            indices.append(i)
            theirs.append(mine)
            their_sizes.append(sizes[k])
            break
        else:
            parts.append(([i], [mine], [sizes[k]]))
    return sorted(sorted(indices) for indices, _, _ in parts)


def _optimizer_settings(env: GrowingHost) -> dict[int, tuple[float, float, float]]:
    """Per parameter (by id): learning rate, momentum, weight decay."""
    settings: dict[int, tuple[float, float, float]] = {}
    for optimizer in env.optimizers():
        for group in optimizer.param_groups:
            for p in group["params"]:
                settings[id(p)] = (group["lr"], group["momentum"], group["weight_decay"])
    return settings
