"""The rollout hooks Esper adds to Lightning's callback interface.

A callback that subclasses :class:`EsperCallback` gets, besides Lightning's usual hooks,
one call per env step with a host-side :class:`StepBatch` and one per finished rollout
with a :class:`RolloutSummary`. Both carry numpy arrays only, so a hook can log or keep
anything without stalling the device; hooks must not touch device tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch import Callback

from esper.contracts.rollout import RolloutSummary, StepBatch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


class EsperCallback(Callback):
    """Base for callbacks that watch the rollout as well as the fit loop."""

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, batch: StepBatch) -> None:
        """Called after every env step, once the step's transition has its reward."""

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, summary: RolloutSummary
    ) -> None:
        """Called after each rollout is collected, before its PPO update."""
