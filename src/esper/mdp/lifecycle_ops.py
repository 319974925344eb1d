"""Carrying out one step's lifecycle ops on a batch of hosts, then the clock's advances.

The vectorised env (:class:`~esper.mdp.env.MorphogeneticVecEnv`) hands this module the
host-side copy of the step's actions and gate signals; everything here is Python work on
the lifecycle (no device reads). The advances that wait only for time are the lifecycle
clock's (:func:`esper.kasmina.clock.after_decision`); this module reports them. Refusals are recorded on each seed's
:class:`~esper.kasmina.lifecycle.SeedLifecycle` (``last_refusal``), their one home, so a
snapshot of a host carries them and a restore brings them back with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from esper.contracts import BlendMode, LifecycleOp, SeedStage
from esper.contracts.rollout import LifecycleEvent
from esper.kasmina import GrowingHost, clock
from esper.kasmina.lifecycle import GateSignals
from esper.tamiyo.masks import MaskBuilder

#: Seed-initialisation generator keys are taken modulo this (torch seeds are 64-bit).
SEED_KEY_MODULUS = 2**63


def seed_key(episode_seed: int, env: int, host_epoch: int, slot: int) -> int:
    """The generator key a seed planted in ``slot`` of ``env`` at ``host_epoch`` is drawn
    from: one per (env, epoch, slot), so one env's choices never shift the random numbers
    another env's seeds are initialised with."""
    return hash((episode_seed, env, host_epoch, slot)) % SEED_KEY_MODULUS


@dataclass(frozen=True)
class StepOutcome:
    """What applying one step's actions did, per env (host-side arrays ``[E]``)."""

    applied: np.ndarray
    refused: np.ndarray
    illegal: np.ndarray
    germinated: np.ndarray
    fossilized: np.ndarray
    pruned: np.ndarray


def lifecycle_event(
    kind: str,
    env: int,
    host: GrowingHost,
    slot_id: str,
    stage_from: SeedStage,
    stage_to: SeedStage,
    host_epoch: int,
    blueprint: str = "",
    reason: str = "",
) -> LifecycleEvent:
    """An event about one slot; the blueprint defaults to the one in the slot now."""
    slot = host.model.slot(slot_id)
    return LifecycleEvent(
        kind=kind,
        env=env,
        slot=slot_id,
        stage_from=stage_from.name,
        stage_to=stage_to.name,
        blueprint=blueprint or (slot.lifecycle.blueprint or ""),
        reason=reason,
        host_epoch=host_epoch,
    )


@dataclass
class _Step:
    """What one call of :meth:`OpApplier.apply` shares between envs and collects."""

    host_epoch: int
    episode_seed: int
    mask_arrays: dict[str, np.ndarray]
    out: dict[str, np.ndarray]
    events: list[LifecycleEvent] = field(default_factory=list)


class OpApplier:
    """Applies the policy's chosen op in each env, then the advances that only wait for time."""

    def __init__(
        self,
        slot_ids: Sequence[str],
        blueprint_names: Sequence[str],
        blend_modes: Sequence[str],
        masks: MaskBuilder,
    ) -> None:
        self.slot_ids = tuple(slot_ids)
        self.blueprint_names = tuple(blueprint_names)
        self.blend_modes = tuple(blend_modes)
        self.masks = masks

    def apply(
        self,
        hosts: Sequence[GrowingHost],
        actions: np.ndarray,
        contribution: np.ndarray,
        grads_finite: np.ndarray,
        mask_arrays: dict[str, np.ndarray],
        active: np.ndarray | None,
        host_epoch: int,
        episode_seed: int,
    ) -> tuple[StepOutcome, list[LifecycleEvent]]:
        """Carry out ``actions [E, 4]`` with gate signals ``[E, S]``; the events, in order.

        ``mask_arrays`` are the host-side masks the actions were sampled under (an action
        they forbid is flagged illegal and changes nothing). Envs where ``active`` is False
        are skipped: the governor just restored them, so their action was chosen from a
        state that no longer exists.
        """
        n = len(hosts)
        out = {k: np.zeros(n, dtype=bool) for k in StepOutcome.__dataclass_fields__}
        step = _Step(host_epoch, episode_seed, mask_arrays, out)
        for e, host in enumerate(hosts):
            if active is not None and not active[e]:
                continue
            self._apply_one(step, e, host, actions[e], contribution[e], grads_finite[e])
            for move in clock.after_decision(host, grads_finite[e], out["germinated"][e]):
                kind, reason = ("refused", move.reason) if move.refused else ("advanced", "clock")
                self._event(step, kind, e, host, move.slot_id, move.stage_from, reason=reason)
        return StepOutcome(**out), step.events

    def _apply_one(
        self,
        step: _Step,
        e: int,
        host: GrowingHost,
        action: np.ndarray,
        contribution: np.ndarray,
        grads_finite: np.ndarray,
    ) -> None:
        """Carry out env ``e``'s chosen op, recording what it did in ``step.out``."""
        out = step.out
        op, s, bp, blend = (int(a) for a in action)
        if not self.masks.is_legal(step.mask_arrays, e, action):
            out["illegal"][e] = True
            return
        if op == LifecycleOp.WAIT:
            return
        slot_id = self.slot_ids[s]
        slot = host.model.slot(slot_id)
        before = slot.stage
        if op == LifecycleOp.GERMINATE:
            name = self.blueprint_names[bp]
            # Seeds are built on the CPU and then moved: seeding the CPU's generator alone
            # keeps the draws per key, and leaves a GPU's generators (which
            # ``torch.manual_seed`` would reseed, and ``fork_rng`` would not restore) alone.
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(
                    seed_key(step.episode_seed, e, step.host_epoch, s)
                )
                host.germinate(slot_id, name, BlendMode(self.blend_modes[blend]))
            out["germinated"][e] = out["applied"][e] = True
            self._event(step, "germinated", e, host, slot_id, before, blueprint=name)
        elif op == LifecycleOp.ADVANCE:
            signals = GateSignals(
                grads_finite=bool(grads_finite[s]),
                contribution=float(contribution[s]),
            )
            result = host.advance(slot_id, signals)
            out["refused"][e] = not result.passed
            out["applied"][e] = result.passed
            out["fossilized"][e] = result.passed and slot.stage is SeedStage.FOSSILIZED
            if result.passed:
                self._event(step, "advanced", e, host, slot_id, before)
                if out["fossilized"][e]:
                    self._event(step, "fossilized", e, host, slot_id, before)
            else:
                self._event(step, "refused", e, host, slot_id, before, reason=result.reason)
        elif op == LifecycleOp.PRUNE:
            blueprint = slot.lifecycle.blueprint or ""
            host.prune(slot_id)
            out["pruned"][e] = out["applied"][e] = True
            self._event(step, "pruned", e, host, slot_id, before, blueprint=blueprint)

    @staticmethod
    def _event(
        step: _Step,
        kind: str,
        e: int,
        host: GrowingHost,
        slot_id: str,
        before: SeedStage,
        blueprint: str = "",
        reason: str = "",
    ) -> None:
        after = host.model.slot(slot_id).stage
        step.events.append(
            lifecycle_event(
                kind, e, host, slot_id, before, after, step.host_epoch, blueprint, reason
            )
        )
