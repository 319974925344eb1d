"""How a widening seed's new units start: drawn at random, or chosen by the loss gradient.

Both start function-preserving (outgoing weights zero). ``random`` keeps the units a
germination draws. ``gradient`` draws ``CANDIDATES_PER_UNIT`` times as many candidate
units, plants them all for one seed-only pass over the host's last training batch, and
keeps the units whose outgoing weights get the largest loss gradient
(:func:`esper.kasmina.widening.unit_scores`): the units the loss most needs, as Firefly
and GradMax select theirs, without GradMax's closed form (which holds for one linear
layer, not for a stage of conv-BN-ReLU). Which one is the default is a measurement
(benchmarks/README.md, "Widening: how new units start").
"""

from __future__ import annotations

import torch
from torch import Tensor

from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import IncubationPass
from esper.kasmina.slot import SeedSlot
from esper.kasmina.widening import Widening, unit_scores

WIDEN_INITS: tuple[str, ...] = ("random", "gradient")
#: Candidate units the gradient-informed start draws per unit it keeps.
CANDIDATES_PER_UNIT = 4


def gradient_selected(
    model: HostModel,
    slot: SeedSlot,
    x: Tensor,
    y: Tensor,
    candidates_per_unit: int = CANDIDATES_PER_UNIT,
) -> Widening:
    """The units of a larger draw that the loss on ``(x, y)`` most needs, as many as
    ``slot``'s freshly planted widening seed has.

    The host's weights, gradients and BatchNorm statistics are left as they were (the
    pass is :class:`~esper.kasmina.incubation.IncubationPass`'s); nothing is read on
    the host (the ranking stays on the device).
    """
    seed = slot.seed
    if not isinstance(seed, Widening):
        raise ValueError(f"slot {slot.slot_id} holds no widening seed to choose units for")
    pool = type(seed)(seed.shape, seed.units * candidates_per_unit).to(x.device)
    was_training = model.training
    slot.seed = pool
    try:
        model.train()
        with torch.enable_grad():  # the rollout loop that germinates holds a no-grad context
            IncubationPass(model, [slot]).loss(x, y).backward()
        index = unit_scores(pool).topk(seed.units).indices.sort().values
        return pool.keep(index)
    finally:
        slot.seed = seed
        model.train(was_training)
