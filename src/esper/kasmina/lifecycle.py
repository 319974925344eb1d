"""The seed lifecycle as a host-side state machine with gates.

One :class:`SeedLifecycle` per slot. It holds Python values only (stage, epochs in
stage, blueprint, blend mode), so reading it never touches the device; the gate
signals it needs (finite gradients, counterfactual contribution) arrive as host values
from the step's one packed transfer.

Two kinds of "no": asking for an edge outside the graph raises
:class:`~esper.contracts.IllegalTransitionError` (a caller bug), while a gate that is
not yet satisfied returns a :class:`GateResult` with the reason (a legal no-op the
observation reports).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from esper.contracts import BlendMode, IllegalTransitionError, SeedStage, check_transition
from esper.contracts.config_errors import owned_by, require_int, require_number
from esper.contracts.stages import COOLDOWN_PATH, LIVE_STAGES, next_on_success_path
from esper.kasmina.blending import blend_alpha

#: Epochs a pruned seed stays PRUNED before its slot's embargo starts.
PRUNED_EPOCHS = 1


@dataclass(frozen=True)
class LifecycleConfig:
    """How long each stage lasts at least, and what a seed must show to be kept.

    Attributes:
        min_training_epochs: epochs a seed trains on its own (alpha 0) before the clock
            moves it to BLENDING; a seed stuck in TRAINING past them may be pruned.
        blend_epochs: epochs of BLENDING, over which the seed's alpha ramps up to 1
            before it moves to HOLDING.
        min_holding_epochs: epochs a seed must hold (alpha 1) before the policy may
            fossilize it.
        min_contribution: a seed fossilizes only if its counterfactual contribution (val
            acc with the seed minus without it) is above this.
        embargo_epochs: epochs a pruned slot stays EMBARGOED before it starts resetting.
        reset_epochs: epochs spent RESETTING before the slot is DORMANT again and can take
            a new seed.
    """

    #: One epoch each: a widening seed starts function-preserving, so it needs no long
    #: incubation or ramp; a policy trained with them ended above one trained with
    #: longer stages (benchmarks/README.md, "Widening the host").
    min_training_epochs: int = 1
    blend_epochs: int = 1
    min_holding_epochs: int = 1
    #: Minimum counterfactual contribution (val acc with the seed minus without it) to fossilize.
    min_contribution: float = 0.0
    #: Epochs a pruned slot stays EMBARGOED before it starts resetting.
    embargo_epochs: int = 2
    #: Epochs spent RESETTING before the slot is DORMANT again.
    reset_epochs: int = 1

    def __post_init__(self) -> None:
        minimums = {
            "min_training_epochs": 0,
            "min_holding_epochs": 0,
            "blend_epochs": 1,  # alpha needs at least one epoch to reach 1
            "embargo_epochs": 1,  # each cool-down stage lasts at least one epoch
            "reset_epochs": 1,
        }
        with owned_by(self):
            for name, minimum in minimums.items():
                require_int(name, getattr(self, name), minimum)
            require_number(
                "min_contribution",
                self.min_contribution,
                hint="a difference in val accuracy (with the seed minus without), e.g. 0.0 or 0.01",
            )

    def epochs_due(self, stage: SeedStage) -> int:
        """Epochs a seed spends in ``stage`` before it may move on (0: time is not what
        it waits for there). The one statement of the timing rules: the gates, the
        cool-down clock and the action masks all read it."""
        return {
            SeedStage.TRAINING: self.min_training_epochs,
            SeedStage.BLENDING: self.blend_epochs,
            SeedStage.HOLDING: self.min_holding_epochs,
            SeedStage.PRUNED: PRUNED_EPOCHS,
            SeedStage.EMBARGOED: self.embargo_epochs,
            SeedStage.RESETTING: self.reset_epochs,
        }.get(stage, 0)

    @functools.cached_property
    def _due_by_stage(self) -> np.ndarray:
        """:meth:`epochs_due` of every stage, indexed by stage value (built once)."""
        due = np.zeros(max(SeedStage) + 1, dtype=np.int64)
        for stage in SeedStage:
            due[stage] = self.epochs_due(stage)
        return due

    def served(self, stages: np.ndarray, epochs_in_stage: np.ndarray) -> np.ndarray:
        """Per seed, whether it has spent its stage's :meth:`epochs_due` (any shape of
        ``stages`` and ``epochs_in_stage`` ints, e.g. ``[E, S]``)."""
        return epochs_in_stage >= self._due_by_stage[stages]


@dataclass(frozen=True)
class GateSignals:
    """What the gates need to know about the last epoch, as host values."""

    grads_finite: bool = True
    #: Validation accuracy with the seed minus with its alpha forced to 0.
    contribution: float = 0.0


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reason: str = ""
    #: Refused only because too few epochs have passed: the seed is waiting, not failing.
    #: Such advances happen on their own once due (the env's clock), and the policy is
    #: never offered them, so they are no decision and cost no reward.
    waiting: bool = False

    def __bool__(self) -> bool:
        return self.passed


PASSED = GateResult(True)


def _waiting(reason: str) -> GateResult:
    return GateResult(False, reason, waiting=True)


class SeedLifecycle:
    """Stage bookkeeping for one slot. Owned by a :class:`~esper.kasmina.slot.SeedSlot`."""

    def __init__(self, config: LifecycleConfig | None = None) -> None:
        self.config = config or LifecycleConfig()
        self.stage = SeedStage.DORMANT
        self.epochs_in_stage = 0
        self.blueprint: str | None = None
        self.blend_mode: BlendMode | None = None
        #: Why the last advance of this seed was refused; "" once one passes (or the seed
        #: was planted or cut). The one record of refusals: the observation's
        #: ``gate_refused`` flag reads it, and a snapshot of the host carries it, so a
        #: restored env observes the refusals it had when the snapshot was taken.
        self.last_refusal: str = ""

    # ------------------------------------------------------------------ queries
    @property
    def is_live(self) -> bool:
        return self.stage in LIVE_STAGES

    @property
    def refused(self) -> bool:
        """The last advance was refused by a gate (for another reason than time)."""
        return bool(self.last_refusal)

    @property
    def alpha(self) -> float:
        """How much of the seed's output the host sees during the current epoch.

        During BLENDING the epoch being trained is epoch ``epochs_in_stage + 1`` of the
        ramp, so the first blending epoch already admits some of the seed and the last
        one admits all of it.
        """
        if self.stage is SeedStage.BLENDING:
            assert self.blend_mode is not None
            progress = (self.epochs_in_stage + 1) / self.config.blend_epochs
            return blend_alpha(self.blend_mode, progress)
        if self.stage in (SeedStage.HOLDING, SeedStage.FOSSILIZED):
            return 1.0
        return 0.0

    # ------------------------------------------------------------- transitions
    def _enter(self, stage: SeedStage) -> None:
        check_transition(self.stage, stage)
        self.stage = stage
        self.epochs_in_stage = 0

    def germinate(self, blueprint: str, blend_mode: BlendMode) -> None:
        mode = BlendMode(blend_mode)  # validate before any state changes
        self._enter(SeedStage.GERMINATED)
        self.blueprint = blueprint
        self.blend_mode = mode
        self.last_refusal = ""

    def build_fossilized(self, blueprint: str, blend_mode: BlendMode) -> None:
        """Start this slot FOSSILIZED with ``blueprint`` in place: a static network.

        Not a transition: no seed grew here. The ``static_final`` control builds a grown
        network's final architecture before its first epoch (``esper.kasmina.architecture``),
        so its seeds are part of the host from the start, as fossilized seeds are. Only a
        fresh slot (DORMANT, no epoch counted) may be built so.
        """
        mode = BlendMode(blend_mode)
        if self.stage is not SeedStage.DORMANT or self.epochs_in_stage:
            raise IllegalTransitionError(
                f"only a fresh DORMANT slot can be built with a fossilized seed; this one is "
                f"{self.stage.name} after {self.epochs_in_stage} epoch(s)"
            )
        self.stage = SeedStage.FOSSILIZED
        self.blueprint = blueprint
        self.blend_mode = mode

    def gate(self, target: SeedStage, signals: GateSignals) -> GateResult:
        """Whether the seed may enter ``target`` now; the reason when not."""
        cfg = self.config
        n = self.epochs_in_stage
        if target is SeedStage.GERMINATED or target is SeedStage.TRAINING:
            return PASSED
        if not signals.grads_finite:
            return GateResult(False, "seed gradients were not finite in the last epoch")
        due = cfg.epochs_due(self.stage)
        if n < due:
            return _waiting(f"{self.stage.name} for {n} of {due} epochs")
        if target is SeedStage.FOSSILIZED and not signals.contribution > cfg.min_contribution:
            return GateResult(
                False,
                f"contribution {signals.contribution:+.4f} is not above "
                f"{cfg.min_contribution:+.4f}",
            )
        return PASSED

    def gate_next(self, signals: GateSignals) -> GateResult:
        """The gate of the next stage on the success path (see :meth:`advance`)."""
        target = next_on_success_path(self.stage)
        if target is None:
            raise IllegalTransitionError(f"no stage follows {self.stage.name} on the success path")
        return self.gate(target, signals)

    def note_refusal(self, result: GateResult) -> None:
        """Record a refusal decided outside :meth:`advance` (the env's clock asks
        :meth:`gate_next` first, so that waiting for time is never recorded)."""
        if result.passed:
            raise ValueError("note_refusal() needs a refused GateResult, got a passed one")
        self.last_refusal = result.reason

    def advance(self, signals: GateSignals) -> GateResult:
        """Move one step along the success path if the gate allows it.

        Raises for a stage with no next step on that path (DORMANT: germinate instead;
        FOSSILIZED and the cool-down stages: nothing to advance).
        """
        target = next_on_success_path(self.stage)
        if target is None:
            raise IllegalTransitionError(
                f"ADVANCE is not defined from {self.stage.name}: it moves a seed along "
                "GERMINATED -> TRAINING -> BLENDING -> HOLDING -> FOSSILIZED "
                "(germinate a DORMANT slot first; cool-down stages advance by the clock)"
            )
        result = self.gate(target, signals)
        if result:
            self._enter(target)
            self.last_refusal = ""
        else:
            self.last_refusal = result.reason
        return result

    def prune(self) -> None:
        self._enter(SeedStage.PRUNED)
        self.last_refusal = ""

    def end_epoch(self) -> SeedStage | None:
        """Count one more epoch in the stage; run the cool-down clock.

        Returns the stage entered by the clock, if any (PRUNED -> EMBARGOED -> RESETTING
        -> DORMANT), so callers can report it.
        """
        self.epochs_in_stage += 1
        if self.stage not in COOLDOWN_PATH[:-1]:
            return None
        if self.epochs_in_stage < self.config.epochs_due(self.stage):
            return None
        nxt = COOLDOWN_PATH[COOLDOWN_PATH.index(self.stage) + 1]
        self._enter(nxt)
        if nxt is SeedStage.DORMANT:
            self.blueprint = None
            self.blend_mode = None
        return nxt
