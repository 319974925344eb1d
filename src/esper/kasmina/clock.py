"""The lifecycle clock: every stage change that waits only for time, in one place.

Two stretches of the lifecycle need no judgement, only epochs (and finite gradients): the
way up, GERMINATED -> TRAINING -> BLENDING -> HOLDING, and the cool-down after a prune,
PRUNED -> EMBARGOED -> RESETTING -> DORMANT. The clock moves seeds along both as soon as
their gate passes, so the policy is never asked (``LifecycleConfig.epochs_due`` says how
long each stage lasts). It ticks at two moments of an env step:

* :func:`after_epoch`, right after each host epoch: every slot counts the epoch, and
  cool-down stages whose time is up move on;
* :func:`after_decision`, right after the policy's ops are carried out: seeds on the way
  up whose gate now passes move on, so the next epoch trains them in their new stage.
  A seed planted by this very decision keeps its GERMINATED epoch.

Both return the moves they made (and refusals for reasons other than time) so the env can
report them; nothing here reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from esper.contracts import SeedStage
from esper.contracts.stages import CLOCK_STAGES
from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.lifecycle import GateSignals


@dataclass(frozen=True)
class ClockMove:
    """One stage change the clock made in a slot, or a refusal it met there.

    ``stage_to`` equals ``stage_from`` for a refusal, whose ``reason`` says why (a refusal
    is reported once, until it clears: waiting for time is never one).
    """

    slot_id: str
    stage_from: SeedStage
    stage_to: SeedStage
    reason: str = ""

    @property
    def refused(self) -> bool:
        return self.stage_to is self.stage_from


def after_epoch(host: GrowingHost) -> list[ClockMove]:
    """Count the epoch just trained in every slot of ``host``; cool-down moves it made."""
    before = {slot.slot_id: slot.stage for slot in host.model.iter_slots()}
    return [ClockMove(s, before[s], stage) for s, stage in host.end_epoch().items()]


def after_decision(
    host: GrowingHost, grads_finite: np.ndarray, just_planted: bool
) -> list[ClockMove]:
    """Move ``host``'s seeds up from the stages that only wait for time.

    ``grads_finite [S]``: per slot (in ``host.model.slot_ids`` order), the seed's
    gradients were finite in the last epoch; ``just_planted``: this decision germinated
    a seed in ``host``, and GERMINATED seeds stay for their first epoch.
    """
    moves = []
    for s, slot_id in enumerate(host.model.slot_ids):
        slot = host.model.slot(slot_id)
        if slot.stage not in CLOCK_STAGES or (just_planted and slot.stage is SeedStage.GERMINATED):
            continue
        signals = GateSignals(grads_finite=bool(grads_finite[s]))
        result = slot.lifecycle.gate_next(signals)
        if result.waiting:
            continue
        before = slot.stage
        if result.passed:
            host.advance(slot_id, signals)
            moves.append(ClockMove(slot_id, before, slot.stage))
        elif not slot.lifecycle.refused:
            slot.lifecycle.note_refusal(result)
            moves.append(ClockMove(slot_id, before, before, result.reason))
    return moves
