"""What a stacked group's envs share and where they differ, worked out once an epoch.

A group (``esper.tolaria.stacked.StackedGroup``) trains its members as one network: this
is the reading of the members that tells it how. Which model runs their forward (a member
with every optional seed and gate any member has, or one built for the group), which
tensors each member's step uses and which some members lack, the stacked shape of each
(the widest member's), the seeds that some members blend in while others incubate them,
the SGD groups, where each member's momentum and seed-gradient flags live. All of it holds
for an epoch: nothing changes which parameters exist within one (``esper.tolaria.epoch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import incubating_slots
from esper.kasmina.slot import SeedSlot
from esper.tolaria.accumulators import EnvAccumulator
from esper.tolaria.host_tensors import HostTensors
from esper.tolaria.stack_grouping import (
    BLEND_STAGES,
    IDLE_STAGES,
    EnvView,
    blending_slots,
    gate_tensors,
    optional_signature,
    optional_tensors,
    trained_tensors,
)
from esper.tolaria.stacked_template import built_template


@dataclass(frozen=True)
class MixedSlot:
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
class GroupPlan:
    """A group's reading of its members (:meth:`of`); per member lists are in member order.

    Attributes:
        template: the model that runs every member's forward, with the group's stacked
            tensors swapped in.
        params, buffers: per member, the parameters and buffers its step uses, by name:
            the same names for every member but the optional ones it lacks.
        like_params, like_buffers: every stacked tensor by name, in the template's order,
            as a member holds it (what the stacked one is made like).
        shapes: each stacked tensor's shape, the widest any member has.
        optional: the names some member lacks (zero rows there, never written back).
        partial_gates: the gates some member lacks, in the template's order (run as 1).
        scaled: the template's slots in TRAINING whose seed some member lacks.
        mixed: the slots the template blends a seed in where some member incubates it.
        partial_alphas, partial_incubations: per alpha (or incubation scale) of a seed
            some member lacks, one of that seed's parameters: the scale runs as 0 on the
            rows of the members without it.
        sgd_groups: parameter names by (lr, momentum, weight decay).
        owners: per member, each parameter its step uses with its optimizer, by name.
        seed_names: the stacked parameters of the seeds the step trains, slot by slot.
        flag_spans: per member, where its trained slots' flags sit in its accumulator
            and in ``seed_names``.
        incubating: the template's slots in TRAINING.
        incubating_names, incubating_buffers: their seeds' parameters and buffers.
        learning_names: what the incubation pass trains.
    """

    template: HostModel
    params: list[dict[str, Tensor]]
    buffers: list[dict[str, Tensor]]
    like_params: dict[str, Tensor]
    like_buffers: dict[str, Tensor]
    shapes: dict[str, torch.Size]
    optional: set[str]
    partial_gates: list[str]
    scaled: list[SeedSlot]
    mixed: list[MixedSlot]
    partial_alphas: dict[str, str | None]
    partial_incubations: dict[str, str | None]
    sgd_groups: dict[tuple[float, float, float], list[str]]
    owners: list[dict[str, tuple[torch.optim.Optimizer, Tensor]]]
    seed_names: list[str]
    flag_spans: list[list[tuple[slice, slice]]]
    incubating: list[SeedSlot]
    incubating_names: set[str]
    learning_names: set[str]
    incubating_buffers: set[str]

    @classmethod
    def of(
        cls,
        envs: Sequence[GrowingHost],
        accs: Sequence[EnvAccumulator],
        views: Sequence[EnvView],
    ) -> GroupPlan:
        """The plan of ``envs`` (with their accumulators ``accs`` and views ``views``, in
        member order) as one group; a ValueError where they cannot train as one (a
        template without a tensor its members train, sizes that do not pad exactly)."""
        signatures = [optional_signature(env, view) for env, view in zip(envs, views, strict=True)]
        every = {name for signature in signatures for name in signature}
        # The model that runs every member's forward: a member with every gate, seed
        # blending in and seed in TRAINING that any member has, else one built for the
        # group (:func:`esper.tolaria.stacked_template.built_template`), whose own tensors no step touches.
        lead = next((g for g, sig in enumerate(signatures) if every <= sig.keys()), None)
        if lead is None:
            template, slot_owners = built_template(envs, signatures)
            template_tensors = HostTensors.of(template)
        else:
            template = envs[lead].model
            slot_owners = {slot_id: envs[lead] for slot_id in template.slot_ids}
            template_tensors = views[lead].tensors
        template_named = template_tensors.named
        template_slots = template_tensors.slots
        names = {id(p): name for name, p in template_named[0].items()}
        # Per env, the parameters and buffers its step uses, by name: the same names for
        # every member, but for the optional ones it lacks (an idle seed's are left out,
        # and with them the template's, whose own tensors the swap keeps but
        # the forward does not run).
        optional_named = [
            optional_tensors(e.model, v.tensors) for e, v in zip(envs, views, strict=True)
        ]
        trained = [
            trained_tensors(e.model, v.tensors, o)
            for e, v, o in zip(envs, views, optional_named, strict=True)
        ]
        params = [t[0] | o[0] for t, o in zip(trained, optional_named, strict=True)]
        buffers = [t[1] | o[1] for t, o in zip(trained, optional_named, strict=True)]
        # Every stacked tensor by name, in the template's order, as a member holds it:
        # what the stacked one is made like (dtype, device, whether it needs a gradient).
        like_params = _first_held(template_named[0], params)
        like_buffers = _first_held(template_named[1], buffers)
        unrun = (like_params.keys() - template_named[0].keys()) | (
            like_buffers.keys() - template_named[1].keys()
        )
        if unrun:
            raise ValueError(
                f"this group's template has no {sorted(unrun)} that its members train; "
                "group envs with stack_groups, which builds a template that has them"
            )
        # Each stacked tensor's shape: the widest any member has, dimension by dimension
        # (members whose layers merged different widenings: the others' rows zero-padded).
        shapes = {
            name: widest([mine[name].shape for mine in tensors if name in mine])
            for tensors in (params, buffers)
            for name in {name for mine in tensors for name in mine}
        }
        padded = any(
            tensor.shape != shapes[name]
            for tensors in (params, buffers)
            for mine in tensors
            for name, tensor in mine.items()
        )
        if padded and not all(view.pad_safe for view in views):
            raise ValueError(
                "members of this group hold tensors of different sizes and not every member "
                "pads exactly (a residual seed, or a host without pads_widths_exactly); group "
                "envs with stack_groups, which keeps such envs apart"
            )
        # The names some member lacks: their rows are zeros there, never written back.
        names_of = [
            own_params.keys() | own_buffers.keys()
            for own_params, own_buffers in zip(params, buffers, strict=True)
        ]
        optional = set.union(*names_of) - set.intersection(*names_of)
        # The gates some member lacks, in the template's order: run as 1 on its row.
        partial_gates = [
            name for name in gate_tensors(template, template_tensors) if name in optional
        ]
        buffer_names = {id(b): name for name, b in template_named[1].items()}
        incubating = incubating_slots(template)

        def first_param(slot: SeedSlot) -> str | None:
            seed_params = template_slots[slot.slot_id].seed[0].values()
            return next((names[id(p)] for p in seed_params), None)

        def lacked(slots: Sequence[SeedSlot]) -> list[SeedSlot]:
            return [slot for slot in slots if first_param(slot) in optional]

        # The template's slots in TRAINING whose seed some member lacks: their
        # incubation is scaled (``SeedSlot.scale_incubation``).
        scaled = lacked(incubating)
        # Per seed some member lacks, by the name of the buffer its slot scales it by (a
        # seed blending in: its alpha, in both passes; in TRAINING: its incubation scale,
        # in the incubation pass), the name of one of its parameters: the scale is run as
        # 0 on the rows of the members without that parameter.
        # The template's slots blending a seed in where some member's seed, the same one
        # (:func:`optional_signature`), is in TRAINING: run for those members at alpha 0
        # in the host's pass and 1 in the incubation pass, the only one they learn from.
        incubated = [{slot.slot_id for slot in incubating_slots(e.model)} for e in envs]

        def mixed_slot(slot: SeedSlot) -> MixedSlot:
            seed_params, seed_buffers = template_slots[slot.slot_id].seed
            blending = [e.model.slot(slot.slot_id).stage in BLEND_STAGES for e in envs]
            return MixedSlot(
                alpha=buffer_names[id(slot.alpha_tensor)],
                params=[names[id(p)] for p in seed_params.values()],
                buffers=[buffer_names[id(b)] for b in seed_buffers.values()],
                blending=blending,
                training=[slot.slot_id in ids for ids in incubated],
                keeps_alpha=any(b and ids for b, ids in zip(blending, incubated, strict=True)),
            )

        mixed_slots = [
            mixed_slot(slot)
            for slot in blending_slots(template)
            if slot.seed is not None and any(slot.slot_id in ids for ids in incubated)
        ]
        mixed_alphas = {mixed.alpha for mixed in mixed_slots}
        partial_alphas = {
            buffer_names[id(slot.alpha_tensor)]: first_param(slot)
            for slot in lacked(blending_slots(template))
            if buffer_names[id(slot.alpha_tensor)] not in mixed_alphas
        }
        partial_incubations = {
            buffer_names[id(slot.incubation_tensor)]: first_param(slot) for slot in scaled
        }
        settings: dict[str, tuple[float, float, float]] = {}  # members agree (stack_key)
        for mine, view in zip(params, views, strict=True):
            for name, p in mine.items():
                if id(p) in view.settings:
                    settings.setdefault(name, view.settings[id(p)])
        # Parameter names by (lr, momentum, weight decay): one SGD group each.
        sgd_groups: dict[tuple[float, float, float], list[str]] = {}
        for name in like_params:
            if name in settings:
                sgd_groups.setdefault(settings[name], []).append(name)
        # Per member, each parameter its step uses, with its optimizer, by name: where
        # its momentum buffer lives. Only those: a member's idle seed can bear the name of
        # the template's incubating one, and must get no state from its row.
        owners = [
            {name: owner for name, owner in _owners_by_name(e, v).items() if name in mine}
            for e, v, mine in zip(envs, views, params, strict=True)
        ]
        # The slots whose seed the step trains: each member's own optimizer holds them.
        slot_ids = template.slot_ids
        trained_slots = [
            s
            for s, slot_id in enumerate(slot_ids)
            if slot_id in slot_owners[slot_id].seed_optimizers
            and template.slot(slot_id).stage not in IDLE_STAGES
        ]
        # Their stacked parameters' names, slot by slot (a seed's, then its gate's).
        by_slot = [
            [
                names[id(p)]
                for p in template_slots[slot_ids[s]].seed_parameters()
                if names[id(p)] in like_params
            ]
            for s in trained_slots
        ]
        seed_names = [name for slot_names in by_slot for name in slot_names]
        # Per member, where each slot's flags that it trains sit in its accumulator (which
        # also lists an idle seed's parameters, and a gate the step does not run) and in
        # ``seed_names`` (which lists a gate the member lacks).
        flag_spans = [
            _flag_spans(acc, trained_slots, [len(n) for n in by_slot], set(_trained_slots(env)))
            for env, acc in zip(envs, accs, strict=True)
        ]
        incubating_names = {
            names[id(p)]
            for slot in incubating
            for p in template_slots[slot.slot_id].seed_parameters()
        }
        # What the incubation pass trains: the seeds in TRAINING, and a mixed slot's seed
        # on its TRAINING rows, the others running it at alpha 0 there or, where one of
        # them incubates a seed (``MixedSlot.keeps_alpha``), masked by row.
        learning_names = incubating_names | {name for mixed in mixed_slots for name in mixed.params}
        incubating_buffers = {
            buffer_names[id(b)]
            for slot in incubating
            for b in template_slots[slot.slot_id].seed[1].values()
        }
        return cls(
            template=template,
            params=params,
            buffers=buffers,
            like_params=like_params,
            like_buffers=like_buffers,
            shapes=shapes,
            optional=optional,
            partial_gates=partial_gates,
            scaled=scaled,
            mixed=mixed_slots,
            partial_alphas=partial_alphas,
            partial_incubations=partial_incubations,
            sgd_groups=sgd_groups,
            owners=owners,
            seed_names=seed_names,
            flag_spans=flag_spans,
            incubating=incubating,
            incubating_names=incubating_names,
            learning_names=learning_names,
            incubating_buffers=incubating_buffers,
        )


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


def _first_held(order: dict[str, Tensor], held: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Each name any of ``held`` has, in ``order``'s order, with the first one's tensor."""
    first: dict[str, Tensor] = {}
    for mine in held:
        for name, tensor in mine.items():
            first.setdefault(name, tensor)
    return {name: first[name] for name in (*order, *first) if name in first}


def widest(shapes: Sequence[torch.Size]) -> torch.Size:
    """The smallest shape that holds each of ``shapes`` (all with as many dimensions)."""
    return torch.Size(max(sizes) for sizes in zip(*shapes, strict=True))
