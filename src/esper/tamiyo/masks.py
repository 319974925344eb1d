"""Action masks for all envs at once, from the lifecycle state Python already holds.

The rules: WAIT is always legal. GERMINATE needs a DORMANT slot and a
blueprint that fits that slot and keeps the env under its parameter budget. ADVANCE is
the policy's only for FOSSILIZE: a HOLDING seed that has held for ``min_holding_epochs``
(the clock takes seeds from GERMINATED to HOLDING by itself:
``esper.kasmina.clock``; how long each stage lasts is ``LifecycleConfig.epochs_due``), so no ADVANCE is offered that a gate would refuse for time alone.
PRUNE needs a seed old enough to judge: one whose contribution is measured (BLENDING,
HOLDING), or one stuck in TRAINING past ``min_training_epochs`` (its gradients were not
finite, so the clock could not move it). The blend head is free for GERMINATE.
The masks are computed with numpy over ``[E, S]`` stage arrays (no per-env Python
branching beyond gathering the stages) and uploaded once per step.
"""

from __future__ import annotations

import numpy as np
import torch

from esper.contracts import ActionSchema, LifecycleOp, SeedStage
from esper.contracts.stages import JUDGEABLE_STAGES
from esper.kasmina.lifecycle import LifecycleConfig
from esper.tamiyo.action_masks import ActionMasks


class MaskBuilder:
    """Turns ``stages [E, S]`` and ``seed_params [E]`` into :class:`ActionMasks`.

    ``fits [S, B]`` says which blueprint fits which slot; ``blueprint_params [S, B]`` is
    the parameter count each blueprint would add in each slot. Both are fixed for a host
    architecture, so they are computed once.
    """

    def __init__(
        self,
        schema: ActionSchema,
        fits: np.ndarray,
        blueprint_params: np.ndarray,
        param_budget: int,
        lifecycle: LifecycleConfig | None = None,
    ) -> None:
        n_slots, n_bps = len(schema.slot_ids), len(schema.blueprint_names)
        if fits.shape != (n_slots, n_bps) or blueprint_params.shape != (n_slots, n_bps):
            raise ValueError(
                f"fits and blueprint_params must be [slots, blueprints] = {(n_slots, n_bps)}, "
                f"got {fits.shape} and {blueprint_params.shape}"
            )
        self.schema = schema
        self.fits = fits.astype(bool)
        self.blueprint_params = blueprint_params.astype(np.int64)
        self.param_budget = param_budget
        self.lifecycle = lifecycle or LifecycleConfig()
        self._judgeable = np.array([int(s) for s in JUDGEABLE_STAGES])

    def build_numpy(
        self, stages: np.ndarray, seed_params: np.ndarray, epochs_in_stage: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The masks as numpy bool arrays: ``op [E, O]``, ``slot [E, O, S]``,
        ``blueprint [E, S, B]``, ``blend [E, NB]``.

        ``stages`` and ``epochs_in_stage`` are ``[E, S]`` ints, ``seed_params`` ``[E]``.
        """
        n_envs, n_slots = stages.shape
        n_ops = len(LifecycleOp)
        room = self.param_budget - seed_params  # [E]
        blueprint = self.fits[None] & (self.blueprint_params[None] <= room[:, None, None])
        dormant = stages == int(SeedStage.DORMANT)
        served = self.lifecycle.served(stages, epochs_in_stage)  # the clock's timing rules
        held = (stages == int(SeedStage.HOLDING)) & served
        stuck = (stages == int(SeedStage.TRAINING)) & served
        slot = np.zeros((n_envs, n_ops, n_slots), dtype=bool)
        slot[:, LifecycleOp.GERMINATE] = dormant & blueprint.any(axis=2)
        slot[:, LifecycleOp.ADVANCE] = held
        slot[:, LifecycleOp.PRUNE] = np.isin(stages, self._judgeable) | stuck
        op = slot.any(axis=2)
        op[:, LifecycleOp.WAIT] = True
        blend = np.ones((n_envs, len(self.schema.blend_modes)), dtype=bool)
        return {"op": op, "slot": slot, "blueprint": blueprint, "blend": blend}

    def upload(self, arrays: dict[str, np.ndarray], device: torch.device) -> ActionMasks:
        """:meth:`build_numpy`'s arrays as device tensors: for a caller that keeps the
        host-side arrays too (the env checks actions against them), so the masks are
        built once per step."""
        pin = torch.device(device).type == "cuda"

        def up(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return ActionMasks(**{k: up(v) for k, v in arrays.items()})

    def is_legal(self, arrays: dict[str, np.ndarray], env: int, action: np.ndarray) -> bool:
        """Whether ``action`` (op, slot, blueprint, blend) was allowed for ``env``."""
        op, slot, bp, blend = (int(a) for a in action)
        if not arrays["op"][env, op]:
            return False
        if op == LifecycleOp.WAIT:
            return True
        if not arrays["slot"][env, op, slot]:
            return False
        if op == LifecycleOp.GERMINATE:
            return bool(arrays["blueprint"][env, slot, bp] and arrays["blend"][env, blend])
        return True
