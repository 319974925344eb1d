"""The rollout hooks Esper adds to Lightning's callback interface.

A callback that subclasses :class:`EsperCallback` keeps every Lightning hook and gains
four more, called by :class:`~esper.simic.module.PPOModule` in this order per
``training_step`` (= one rollout and its PPO update)::

    on_rollout_start -> on_env_step x (episode_epochs - 1) -> on_rollout_end
                     -> on_ppo_update_end

Every argument is host-side (numpy arrays, Python numbers): it came over in the step's
single packed device-to-host transfer. A hook may read, log and keep anything it is given
without stalling the device; it must not read device tensors of the module, or the
rollout stops being sync-free (the host-read tests run with the built-in callbacks on).

Plain ``lightning.pytorch.Callback`` objects work beside these; they simply never see
the rollout hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback

from esper.contracts.rollout import RolloutSummary, StepBatch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


def check_state_version(owner: str, state_dict: dict[str, Any], reads: int) -> None:
    """Refuse a callback state written by another version of its layout, saying what to do.

    ``owner`` names the callback in the message; ``reads`` is the version this code reads.
    """
    version = state_dict.get("version")
    if version != reads:
        raise ValueError(
            f"{owner} state has version {version!r}, this code reads {reads}; resume with "
            "the esper version that wrote the checkpoint"
        )


class EsperCallback(Callback):
    """Base for callbacks that watch (or, like the governor, steer) the rollout."""

    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        """Before the envs are reset for rollout ``rollout`` (0-based; = the PPO update index).

        May change: nothing of the module; a good place to reset per-rollout counters.
        """

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        """After each env step, once its transition has a reward.

        Runs right after the read that closed the transition and before the next actions
        are applied. May change: nothing. Snapshots and per-env restores are the
        governor's (``esper.mdp.governor.Governor``, whose ``steer`` the rollout calls at
        each read with its control surface), not a step hook's.
        """

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        """After the rollout is collected and its advantages computed, before the update.

        May change: nothing; the buffer is final.
        """

    def on_ppo_update_end(
        self, trainer: Trainer, pl_module: LightningModule, metrics: dict[str, float]
    ) -> None:
        """After the PPO update, with the update's and the rollout's metrics as floats.

        ``metrics`` holds what was also logged (``ppo/*``, ``train/*``, ``perf/*``).
        May change: nothing of the module.
        """
