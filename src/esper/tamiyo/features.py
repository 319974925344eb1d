"""The policy's observation, built on the device for all envs at once.

Two sources meet here. The host metrics of the epoch (losses, accuracies, counterfactual
contributions) are device tensors from ``run_epoch``; reading them first would cost a
sync. The lifecycle state (stage, epochs in stage, alpha, blueprint, last refusal) and
the episode clock live in Python already. So Python fills its part of the vector on the
host, uploads it (non-blocking, pinned on CUDA), and the device part is written into the
uploaded tensor in place. Positions come from :class:`ObservationLayout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from esper.contracts import ObservationLayout, SeedStage
from esper.contracts.observations import GLOBAL_FEATURES, SLOT_SCALAR_FEATURES
from esper.tolaria.epoch import EpochResult

#: Device-side global features, in the order they are written.
_DEVICE_GLOBALS: tuple[str, ...] = (
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "val_acc_delta",
    "best_val_acc",
)
#: Losses can blow up (the governor's business); the policy sees them clamped to this.
LOSS_CLAMP = 100.0


@dataclass(frozen=True)
class SlotState:
    """What Python knows about one slot at observation time."""

    stage: SeedStage
    epochs_in_stage: int
    alpha: float
    blueprint_index: int | None
    gate_refused: bool


@dataclass(frozen=True)
class EnvState:
    """What Python knows about one env at observation time."""

    host_epoch: int
    seed_params: int
    slots: Sequence[SlotState]


class ObservationBuilder:
    """Builds ``obs [E, layout.dim]`` from an epoch's device tensors and Python's state."""

    def __init__(
        self,
        layout: ObservationLayout,
        episode_epochs: int,
        param_budget: int,
        device: torch.device,
    ) -> None:
        if episode_epochs < 1:
            raise ValueError(f"episode_epochs must be >= 1, got {episode_epochs}")
        if param_budget < 1:
            raise ValueError(f"param_budget must be >= 1, got {param_budget}")
        self.layout = layout
        self.episode_epochs = episode_epochs
        self.param_budget = param_budget
        self.device = torch.device(device)
        self._global = {name: layout[name].start for name in GLOBAL_FEATURES}
        self._n_global = len(GLOBAL_FEATURES)
        self._slot_offsets = {
            name: i for i, name in enumerate(SLOT_SCALAR_FEATURES)
        }  # within a slot's block
        self._stage_offset = len(SLOT_SCALAR_FEATURES)
        self._blueprint_offset = self._stage_offset + len(SeedStage)
        first = self._global[_DEVICE_GLOBALS[0]]
        if [self._global[n] for n in _DEVICE_GLOBALS] != list(
            range(first, first + len(_DEVICE_GLOBALS))
        ):
            raise AssertionError("device-side global features must be contiguous in the layout")
        self._device_globals = slice(first, first + len(_DEVICE_GLOBALS))

    def host_part(self, envs: Sequence[EnvState]) -> np.ndarray:
        """The Python-known features, zeros where the device part goes. ``[E, D]`` float32."""
        layout = self.layout
        out = np.zeros((len(envs), layout.dim), dtype=np.float32)
        width = layout.slot_width
        for e, env in enumerate(envs):
            if len(env.slots) != layout.n_slots:
                raise ValueError(
                    f"env {e} reports {len(env.slots)} slots; the layout has {layout.n_slots}"
                )
            out[e, self._global["epoch_fraction"]] = env.host_epoch / self.episode_epochs
            out[e, self._global["params_ratio"]] = env.seed_params / self.param_budget
            for s, slot in enumerate(env.slots):
                base = self._n_global + s * width
                out[e, base + self._slot_offsets["epochs_in_stage"]] = (
                    slot.epochs_in_stage / self.episode_epochs
                )
                out[e, base + self._slot_offsets["alpha"]] = slot.alpha
                out[e, base + self._slot_offsets["gate_refused"]] = float(slot.gate_refused)
                out[e, base + self._stage_offset + int(slot.stage)] = 1.0
                if slot.blueprint_index is not None:
                    out[e, base + self._blueprint_offset + slot.blueprint_index] = 1.0
        return out

    def build(
        self,
        result: EpochResult,
        prev_val_acc: Tensor,
        best_val_acc: Tensor,
        envs: Sequence[EnvState],
    ) -> Tensor:
        """``obs [E, D]`` on the device; ``prev_val_acc``/``best_val_acc`` are ``[E]`` device tensors."""
        host = torch.from_numpy(self.host_part(envs))
        if self.device.type == "cuda":
            host = host.pin_memory()
        obs = host.to(self.device, non_blocking=True)
        device_globals = torch.stack(
            [
                result.train_loss.clamp(max=LOSS_CLAMP),
                result.train_acc,
                result.val_loss.clamp(max=LOSS_CLAMP),
                result.val_acc,
                result.val_acc - prev_val_acc,
                best_val_acc,
            ],
            dim=1,
        )
        obs[:, self._device_globals] = torch.nan_to_num(
            device_globals, nan=LOSS_CLAMP, posinf=LOSS_CLAMP, neginf=-LOSS_CLAMP
        )
        slots = obs[:, self._n_global :].view(len(envs), self.layout.n_slots, -1)
        slots[:, :, self._slot_offsets["contribution"]] = result.contribution
        return obs
