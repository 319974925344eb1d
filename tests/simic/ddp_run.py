"""A 2-rank DDP run on CPU (gloo), launched by tests/simic/test_ddp.py as a script.

Lightning's ``ddp`` strategy starts the second rank by re-running this script, so it must
be a plain script rather than a pytest function. Each rank saves, after every PPO update,
its policy weights, normaliser statistics and its own rollout's returns to ``OUT``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L
import torch

from esper.callbacks.base import EsperCallback
from esper.simic.module import PPOModule
from tests.mdp.envs import small_data

N_RANKS = 2
UPDATES = 2


class SaveEachUpdate(EsperCallback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.returns: list[list[float]] = []

    def on_rollout_end(self, trainer, pl_module, rollout) -> None:  # type: ignore[no-untyped-def]
        self.returns.append(rollout.episode_return.tolist())

    def on_ppo_update_end(self, trainer, pl_module, metrics) -> None:  # type: ignore[no-untyped-def]
        rank, update = trainer.global_rank, pl_module.current_epoch
        torch.save(
            {
                "policy": pl_module.policy.state_dict(),
                "normalizer": pl_module.normalizer.state_dict(),
                "returns": self.returns[-1],
                "n_envs": pl_module.env.n_envs,
                "metrics": metrics,
            },
            self.out / f"rank{rank}_update{update}.pt",
        )


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    module = PPOModule(n_envs=4, episode_epochs=3, host_kwargs={"channels": [4, 8]})
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=N_RANKS,
        max_epochs=UPDATES,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveEachUpdate(out)],
    )
    trainer.fit(module, datamodule=small_data())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
