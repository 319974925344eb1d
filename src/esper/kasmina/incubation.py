"""How a seed in TRAINING learns without touching the host: a second, seed-only pass.

The seed must come out of TRAINING as a fitted residual, so that blending it in does not
make the host worse. It learns here by minimising the host's own loss with the seed
added at full strength (``h + seed(h)`` in its slot), against the host as it is now: the
residual it will be once blended.

Why not one pass with a straight-through term (``h + (delta - delta.detach())``, the
earlier method): it hands the seed the gradient of a loss that is *linear* in the
seed's output, so nothing bounds that output, and the first blending epochs then added
an arbitrarily large perturbation to the host (benchmarks/README.md, "Design figures
kept out of docstrings": the host's accuracy fell three times as far when the first seed
started blending).

Gradient isolation holds: the host's step comes from its ordinary forward, in which a
TRAINING slot passes its input through unchanged, so the host's gradients are exactly
those of the host alone. This pass runs the model with every host parameter taken out
of autograd (``requires_grad`` off for the forward) and every host buffer put back as it
was afterwards (BatchNorm's running statistics do not see it), so only the incubating
seeds' parameters get gradients, and only their own buffers update. It costs one more
forward and a seed-only backward per batch, and only while some slot of the host has a
seed in TRAINING. The forward starts at the first incubating slot, from what reached it
in the host's own forward of the same batch (:func:`recording_start`): the layers before
it would compute exactly that again, since no optimiser has stepped in between, so the
seed gradients are bit-identical and the pass shorter the later the slot (figures in the
same section of benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from esper.contracts import SeedStage
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.slot import SeedSlot


def incubating_slots(model: HostModel) -> list[SeedSlot]:
    """The host's slots whose seed is in TRAINING: the ones :func:`incubation_loss` trains."""
    return [
        slot
        for slot in model.iter_slots()
        if slot.stage is SeedStage.TRAINING and slot.seed is not None
    ]


@contextmanager
def seeds_incubating(slots: Sequence[SeedSlot], scaled: Sequence[SeedSlot] = ()) -> Iterator[None]:
    """Within the block, each of ``slots`` adds its TRAINING seed at alpha 1, those of
    ``scaled`` multiplied by their ``incubation_tensor`` (the stacked engine's)."""
    for slot in slots:
        slot.incubating = True
    for slot in scaled:
        slot.scale_incubation = True
    try:
        yield
    finally:
        for slot in slots:
            slot.incubating = False
        for slot in scaled:
            slot.scale_incubation = False


@dataclass
class IncubationStart:
    """Where the incubation pass begins: slot ``index`` (``model.slots`` order), fed
    ``slot_input`` and ``slot_context``, what reached that slot in the host's own
    forward of the same batch."""

    index: int
    slot_input: Tensor | None = None
    slot_context: Tensor | None = None


def resumes_at_slots(model: HostModel) -> bool:
    """Whether the host can run its forward from a slot (it overrides ``forward_from_slot``)."""
    return type(model).forward_from_slot is not HostModel.forward_from_slot


@contextmanager
def recording_start(
    model: HostModel, slots: Sequence[SeedSlot]
) -> Iterator[IncubationStart | None]:
    """Record what reaches the first of ``slots`` during the host's forward in this block.

    Run the host's own forward of a batch inside it, then pass what it yields to
    :func:`incubation_loss` for the same batch before any optimiser step. Yields None
    where the pass must run whole: no slots, or a host that does not resume at a slot.
    """
    if not slots or not resumes_at_slots(model):
        yield None
        return
    ids = model.slot_ids
    index = min(ids.index(slot.slot_id) for slot in slots)
    start = IncubationStart(index)

    def record(_module: nn.Module, args: tuple[Tensor | None, ...]) -> None:
        assert args[0] is not None
        start.slot_input = args[0].detach()
        context = args[1] if len(args) > 1 else None
        start.slot_context = None if context is None else context.detach()

    handle = model.slot(ids[index]).register_forward_pre_hook(record)
    try:
        yield start
    finally:
        handle.remove()


class IncubationPass:
    """The seed-only pass of one host's incubating ``slots``, for as long as their stages
    hold (an epoch: lifecycle ops run between epochs).

    Which parameters and buffers are the host's is listed once, not per batch. The pass
    runs the host's own modules: ``functional_call`` with detached host parameters and
    cloned buffers computes the same, but swapping every module attribute in and out cost
    more Python per batch than the pass's forward itself, and a train step's Python holds
    the interpreter lock the worker threads share (``esper.tolaria.parallel``). The
    host's flags and buffers are restored even when the forward raises.
    """

    def __init__(self, model: HostModel, slots: Sequence[SeedSlot]) -> None:
        self.model = model
        self.slots = list(slots)
        seed_params = {id(p) for slot in self.slots for p in slot.seed_parameters()}
        seed_buffers = {
            id(b) for slot in self.slots if slot.seed is not None for b in slot.seed.buffers()
        }
        self._host_params = [p for p in model.parameters() if id(p) not in seed_params]
        #: Where each host buffer sits, and its module: the pass swaps a stand-in in (the
        #: forward updates it, and the seed's backward may need it unchanged), then the
        #: buffer back. A slot's own buffers (its alpha, its device anchor) are left out:
        #: lifecycle ops write them between epochs, a forward only reads them.
        self._host_buffers = [
            (module, name)
            for module in model.modules()
            if not isinstance(module, SeedSlot)
            for name, b in module._buffers.items()
            if b is not None and id(b) not in seed_buffers
        ]

    def loss(self, x: Tensor, y: Tensor, start: IncubationStart | None = None) -> Tensor:
        """The host's loss on ``(x, y)`` with each seed added at alpha 1 (see
        :func:`incubation_loss`)."""
        slot_input = None if start is None else start.slot_input
        if slot_input is not None and slot_input.shape[0] != x.shape[0]:
            raise ValueError(
                f"the recorded slot input holds {slot_input.shape[0]} samples but the batch "
                f"holds {x.shape[0]}; record the start in the host's forward of this batch "
                "(recording_start)"
            )
        buffers = [module._buffers[name] for module, name in self._host_buffers]
        tracked = [p.requires_grad for p in self._host_params]
        try:
            with torch.no_grad():
                for (module, name), b in zip(self._host_buffers, buffers, strict=True):
                    module._buffers[name] = _stand_in(module, b)
            for p in self._host_params:
                p.requires_grad_(False)
            with seeds_incubating(self.slots):
                if slot_input is None:
                    outputs = self.model(x)
                else:
                    assert start is not None
                    outputs = self.model.forward_from_slot(
                        start.index, slot_input, start.slot_context
                    )
        finally:
            for p, flag in zip(self._host_params, tracked, strict=True):
                p.requires_grad_(flag)
            for (module, name), b in zip(self._host_buffers, buffers, strict=True):
                module._buffers[name] = b
        loss, _, _ = self.model.loss_and_correct(outputs, y)
        return loss


def _stand_in(module: nn.Module, buffer: Tensor) -> Tensor | None:
    """What the pass puts in place of one of ``module``'s buffers: a clone, or nothing for
    a batch norm's running statistics while it trains.

    Why nothing there: in training mode a batch norm normalises by the batch's own
    statistics and only writes the running ones (and its batch count), and given None it
    writes nothing (``nn.BatchNorm2d.forward``); so its output and gradients are those of
    the cloned buffers, bit for bit, without a copy. A clone is a kernel call, and each
    releases and retakes the interpreter lock that the CPU's worker threads share
    (``esper.tolaria.parallel``): nine a step for the predecessor's host.
    """
    if isinstance(module, _BatchNorm) and module.training:
        return None
    return buffer.clone()


def incubation_loss(
    model: HostModel,
    slots: Sequence[SeedSlot],
    x: Tensor,
    y: Tensor,
    start: IncubationStart | None = None,
) -> Tensor:
    """The host's loss on ``(x, y)`` with each of ``slots``' seeds added at alpha 1.

    Its graph reaches only those seeds' parameters (see the module docstring), so
    ``backward()`` on it trains them and leaves every host gradient as it was. With a
    recorded ``start`` (:func:`recording_start`) the forward begins at that slot. For
    many batches of one epoch, build an :class:`IncubationPass` once instead.
    """
    return IncubationPass(model, slots).loss(x, y, start)
