"""PPOModule runs the policy's side of an update at the policy's own thread count."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

import esper.simic.module as module_source
from esper.simic.module import PPOModule
from esper.tolaria.data import SyntheticImageDataModule
from tests.mdp.envs import small_data
from tests.trainers import quiet_trainer


def test_the_ppo_update_and_the_collector_take_the_policy_s_cpu_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2,
        episode_epochs=3,
        host_kwargs={"channels": [4, 8]},
        policy={"hidden_size": 16, "cpu_threads": 1},
    )
    update = module_source.ppo_update
    counts: list[int] = []

    def counting_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts.append(torch.get_num_threads())
        return update(*args, **kwargs)

    monkeypatch.setattr(module_source, "ppo_update", counting_update)
    trainer = quiet_trainer(tmp_path)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer.fit(module, datamodule=small_data())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    assert counts == [1]
    assert module.collector is not None and module.collector.policy_threads == 1


def test_a_mixed_precision_fit_autocasts_its_update_and_not_its_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--trainer.precision bf16-mixed`` is the PPO update's precision; hosts train at
    ``amp``'s (off here), outside the trainer's autocast, whose cast weights would not see
    the steps that move them."""
    L.seed_everything(0, verbose=False)
    module = PPOModule(n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]})
    seen: dict[str, list[bool]] = {"rollout": [], "update": []}
    train_epoch = module_source.MorphogeneticVecEnv.train_epoch
    update = module_source.ppo_update

    def noted_epoch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["rollout"].append(torch.is_autocast_enabled("cpu"))
        return train_epoch(self, *args, **kwargs)

    def noted_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["update"].append(torch.is_autocast_enabled("cpu"))
        return update(*args, **kwargs)

    monkeypatch.setattr(module_source.MorphogeneticVecEnv, "train_epoch", noted_epoch)
    monkeypatch.setattr(module_source, "ppo_update", noted_update)
    trainer = quiet_trainer(tmp_path, 1, accelerator="cpu", precision="bf16-mixed")
    trainer.fit(module, datamodule=small_data())
    assert seen["rollout"] and not any(seen["rollout"])
    assert seen["update"] == [True]


def test_a_scaled_precision_is_refused_naming_the_ones_that_work(tmp_path: Path) -> None:
    """16-mixed scales the loss for its GradScaler; the update clips gradients before its
    fused Adam step unscales them, so it would clip scaled gradients (tried on this CPU
    with a scaler: gradient norm NaN, no step taken). A GPU keeps 16-mixed as asked (a
    CPU trainer turns it into bf16-mixed), so the scaler is given here."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from esper.contracts.config_errors import ConfigError

    L.seed_everything(0, verbose=False)
    module = PPOModule(n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]})
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = quiet_trainer(tmp_path, 1, accelerator="cpu", plugins=[scaled])
    with pytest.raises(ConfigError, match=r"trainer\.precision: is '16-mixed': its gradient"):
        trainer.fit(module, datamodule=small_data())


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_a_true_precision_is_refused_before_update_1_fails(tmp_path: Path, precision: str) -> None:
    """A true precision makes its dtype torch's default during the training step, where
    the episode's hosts are built: their weights then did not match their float32 data
    and update 1 failed with a dtype error that named neither the cause nor the fix."""
    from esper.contracts.config_errors import ConfigError

    module = PPOModule(n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]})
    trainer = quiet_trainer(tmp_path, 1, accelerator="cpu", precision=precision)
    with pytest.raises(
        ConfigError, match=rf"is '{precision}': a true precision.*use 32-true or bf16-mixed"
    ):
        trainer.fit(module, datamodule=small_data())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("resident_bytes", [2**30, 0])
def test_a_fit_on_a_gpu_trains_from_splits_on_the_gpu_or_on_the_host(
    tmp_path: Path, resident_bytes: int
) -> None:
    """A fit on a GPU gathers its host batches there when the splits fit resident_bytes,
    else on the host; the fit runs alike both ways."""
    L.seed_everything(0, verbose=False)
    module = PPOModule(n_envs=2, episode_epochs=2, host_kwargs={"channels": [4, 8]})
    data = SyntheticImageDataModule(
        n_train=64, n_val=32, batch_size=16, val_batch_size=32, resident_bytes=resident_bytes
    )
    trainer = quiet_trainer(tmp_path, max_epochs=2, accelerator="gpu", devices=1)
    trainer.fit(module, datamodule=data)
    assert module.env is not None
    rows = module.env._train_loader.dataset
    assert rows.tensors[0].device.type == ("cuda" if resident_bytes else "cpu")
    losses = [module.last_metrics[f"ppo/{name}"] for name in ("policy_loss", "value_loss")]
    assert all(math.isfinite(loss) for loss in losses)
