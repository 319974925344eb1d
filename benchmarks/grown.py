"""Hosts grown apart, as a fit makes them, for the benchmarks that time host training.

Fresh hosts are alike, the stacked engine's best case: every env trains in one group
running no seed. A fit's hosts differ: each slot of each env is empty, or holds a
widening (the CNN's default blueprint) in TRAINING, BLENDING or HOLDING, or has merged
one (wider layers). :func:`grown_apart` draws that per slot, seeded, so every run and
every engine times the same hosts. Build the hosts with :data:`QUICK`, whose gates let a
seed reach any stage at once.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import GateSignals, GrowingHost, LifecycleConfig

#: What is drawn for each slot: empty, or a widening at one of these stages.
GROWN_STAGES: tuple[SeedStage | None, ...] = (
    None,
    SeedStage.TRAINING,
    SeedStage.BLENDING,
    SeedStage.HOLDING,
    SeedStage.FOSSILIZED,
)
#: Lifecycle gates that let a seed reach any stage at once.
QUICK = LifecycleConfig(min_training_epochs=0, blend_epochs=2, min_holding_epochs=0)
PASSING = GateSignals(grads_finite=True, contribution=1.0)
#: Lifecycle steps a slot may take to reach its stage (each gate passes within a few).
MAX_ADVANCES = 10
#: The draw's seed: the same hosts in every run.
SEED = 0


def grown_apart(envs: Sequence[GrowingHost], seed: int = SEED) -> None:
    """Each slot of each of ``envs`` left empty or given a widening at a drawn stage."""
    draw = random.Random(seed)
    for env in envs:
        grow(env, draw)


def grow(env: GrowingHost, draw: random.Random) -> None:
    """Each slot of ``env`` left empty or given a widening brought to a drawn stage."""
    for slot_id in env.slot_ids:
        stage = draw.choice(GROWN_STAGES)
        if stage is None:
            continue
        env.germinate(slot_id, "widen", BlendMode.LINEAR)
        slot = env.model.slot(slot_id)
        for _ in range(MAX_ADVANCES):
            if slot.stage >= stage:
                break
            if not env.advance(slot_id, PASSING):
                slot.end_epoch()
        if slot.stage < stage:
            raise RuntimeError(f"{slot_id} stuck at {slot.stage.name} on the way to {stage.name}")
