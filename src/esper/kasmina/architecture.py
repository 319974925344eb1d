"""A grown network's final architecture, read off at an episode's end and built from scratch.

Growth is judged against the network it ends as, trained from the first epoch with the
same recipe (the ``static_final`` control): the architecture without the growing. That
network is the host plus every seed whose output it adds at the end: seeds in BLENDING,
HOLDING or FOSSILIZED. A seed still GERMINATED or in TRAINING adds nothing to the
output (alpha 0), so it is not part of the final network; a pruned one is gone.

:func:`final_architecture` reads that off a host; :func:`build_architecture` puts it
into a fresh host of the same family, each seed fossilized (part of the host, alpha 1,
trained by the host's optimizer) before any training; :func:`final_param_count` counts
the final network's parameters, so a grower's row and its static control's row count
the same network.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.sizing import count_parameters
from esper.kasmina.widening import reset_modules


@dataclass(frozen=True)
class SlotSeed:
    """The seed one slot holds in a final architecture."""

    blueprint: str
    blend_mode: BlendMode


#: Per slot of the host, in ``HostModel.slot_ids`` order: its seed, or None.
Architecture = tuple[SlotSeed | None, ...]


def final_architecture(model: HostModel) -> Architecture:
    """The seeds whose output ``model`` adds now, slot by slot (None: nothing)."""
    seeds: list[SlotSeed | None] = []
    for slot in model.iter_slots():
        mode = slot.lifecycle.blend_mode
        bp = slot.lifecycle.blueprint
        if slot.blends_output and bp is not None and mode is not None:
            seeds.append(SlotSeed(bp, mode))
        else:
            seeds.append(None)
    return tuple(seeds)


def final_param_count(model: HostModel) -> int:
    """Parameters of the network ``model`` computes now: the host and the seeds of its
    :func:`final_architecture`; seeds that add nothing yet are left out.

    A widening seed still blending or holding counts as merged: the network it computes is
    the plain wider one, whose parameters :func:`build_architecture` builds for
    ``static_final`` (the blocks between old and new units that are zero while it lives
    included), so a grower's row and its static control's count the same network.
    """
    live = [s.slot_id for s in model.iter_slots() if s.widens and s.blends_output]
    if live:
        model = copy.deepcopy(model)
        for slot_id in live:
            model.slot(slot_id).lifecycle.stage = SeedStage.FOSSILIZED  # a copy, counted only
            model.merge_widening(slot_id)
    unused = sum(slot.seed_param_count() for slot in model.iter_slots() if not slot.blends_output)
    return count_parameters(model) - unused


def build_architecture(
    model: HostModel,
    architecture: Sequence[SlotSeed | None],
    seed_keys: Sequence[int] | None = None,
) -> None:
    """Build each seed of ``architecture`` into fresh ``model`` as a fossilized seed.

    Residual seeds are initialised as a germination would (zero output). A widening
    seed is merged into the host's layers and those layers are initialised afresh, as
    any layer of a network built at that width is: the control is the plain wider
    network, not one whose new units start silent. ``seed_keys`` (one per slot) seeds
    the random generator each slot's seed is drawn from, forked so that no other draw
    moves; None draws them from the global generator as it stands.
    """
    if len(architecture) != len(model.slot_ids):
        raise ValueError(
            f"the architecture lists {len(architecture)} slots but the host has "
            f"{len(model.slot_ids)} ({list(model.slot_ids)}); build it on the host family "
            "it was read from"
        )
    if seed_keys is not None and len(seed_keys) != len(architecture):
        raise ValueError(f"{len(seed_keys)} seed keys for {len(architecture)} slots")
    for s, (slot, seed) in enumerate(zip(model.iter_slots(), architecture, strict=True)):
        if seed is None:
            continue
        if seed_keys is None:
            _build(model, slot.slot_id, seed)
            continue
        with torch.random.fork_rng(devices=[]):  # built on the CPU: its generator alone
            torch.default_generator.manual_seed(seed_keys[s])
            _build(model, slot.slot_id, seed)


def _build(model: HostModel, slot_id: str, seed: SlotSeed) -> None:
    slot = model.slot(slot_id)
    slot.build_fossilized(seed.blueprint, seed.blend_mode)
    if slot.widens:
        model.merge_widening(slot_id)
        reset_modules(model.widened_layers(slot_id))
