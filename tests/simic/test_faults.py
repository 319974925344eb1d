"""Faults end the run with a clear message and lose no checkpoint, or (OOM, when asked)
let the one env sit out its epoch while the run goes on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from esper.callbacks.base import EsperCallback
from esper.callbacks.checkpoint import EsperCheckpointIO, default_checkpoints
from esper.contracts.rollout import StepBatch
from esper.simic.module import PPOModule, RunFailure
from esper.tolaria.data import DataSplits, SyntheticImageDataModule
from tests.mdp.envs import small_data
from tests.trainers import quiet_trainer

#: Faults are planted during this update (0-based), after update 0 was checkpointed.
FAULTY_UPDATE = 1
FAULTY_ENV = 1


class KeepWeights(EsperCallback):
    """Remembers the policy after each update, to compare with the checkpoint."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.steps: list[StepBatch] = []

    def on_env_step(self, trainer, pl_module, step) -> None:  # type: ignore[no-untyped-def]
        self.steps.append(step)

    def on_ppo_update_end(self, trainer, pl_module, metrics) -> None:  # type: ignore[no-untyped-def]
        state = pl_module.policy.state_dict()
        self.after[pl_module.current_epoch] = {k: v.clone() for k, v in state.items()}


def _fit(
    root: Path,
    callbacks: list[Any],
    datamodule: Any = None,
    max_epochs: int = 3,
    ckpt_path: str | None = None,
    **module_kwargs: Any,
) -> PPOModule:
    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]}, **module_kwargs
    )
    trainer = quiet_trainer(
        root,
        max_epochs,
        callbacks=[*default_checkpoints(), *callbacks],
        enable_checkpointing=True,
    )
    trainer.fit(module, datamodule=datamodule or small_data(), ckpt_path=ckpt_path)
    return module


def _assert_checkpoint_kept(root: Path, keep: KeepWeights) -> None:
    """last.ckpt holds exactly the policy after the last complete update, and resumes."""
    last = root / "checkpoints" / "last.ckpt"
    checkpoint = EsperCheckpointIO().load_checkpoint(last)
    assert checkpoint["epoch"] == FAULTY_UPDATE - 1
    saved = {k.removeprefix("policy."): v for k, v in checkpoint["state_dict"].items()}
    for name, value in keep.after[FAULTY_UPDATE - 1].items():
        assert torch.equal(saved[name], value), name
    resumed = _fit(root, [], max_epochs=FAULTY_UPDATE + 1, ckpt_path="last")
    assert resumed.current_epoch == FAULTY_UPDATE + 1


# --------------------------------------------------------------- data loader worker
class _CrashAfterFlag(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Kills the worker process that loads it once ``flag`` exists."""

    def __init__(self, data: TensorDataset, flag: Path) -> None:
        self.data, self.flag = data, flag

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flag.exists():
            os._exit(3)
        return self.data[i]


class _CrashingData(SyntheticImageDataModule):
    def __init__(self, flag: Path) -> None:
        super().__init__(n_train=64, n_val=32, batch_size=16, val_batch_size=32, num_workers=1)
        self.flag = flag

    def _build_datasets(self) -> DataSplits:
        splits = super()._build_datasets()
        return splits._replace(train=_CrashAfterFlag(splits.train, self.flag))  # type: ignore[arg-type]


class _RaiseFlag(EsperCallback):
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def on_ppo_update_end(self, trainer, pl_module, metrics) -> None:  # type: ignore[no-untyped-def]
        if pl_module.current_epoch == FAULTY_UPDATE - 1:
            self.flag.touch()


@pytest.mark.slow
def test_a_dead_data_loader_worker_ends_the_run_naming_it_and_the_checkpoint(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "crash-now"
    keep = KeepWeights()
    with pytest.raises(RunFailure) as caught:
        _fit(tmp_path, [keep, _RaiseFlag(flag)], datamodule=_CrashingData(flag))
    message = str(caught.value)
    assert "data loader worker died" in message
    assert "last.ckpt" in message and "--ckpt_path last" in message
    flag.unlink()
    _assert_checkpoint_kept(tmp_path, keep)


# ----------------------------------------------------------------------- OOM
class _InjectOOM(EsperCallback):
    """Makes env FAULTY_ENV's host raise an out-of-memory error once, mid-update."""

    def __init__(self) -> None:
        self.fired = False

    def on_env_step(self, trainer, pl_module, step) -> None:  # type: ignore[no-untyped-def]
        if self.fired or pl_module.current_epoch != FAULTY_UPDATE:
            return
        model = pl_module.env.hosts[FAULTY_ENV].model
        forward = model.forward

        def out_of_memory(*args: Any, **kwargs: Any) -> Any:
            model.forward = forward  # once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        model.forward = out_of_memory
        self.fired = True


@pytest.mark.slow
def test_out_of_memory_ends_the_run_naming_the_env_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    keep = KeepWeights()
    with pytest.raises(RunFailure) as caught:
        _fit(tmp_path, [keep, _InjectOOM()])
    message = str(caught.value)
    assert f"env {FAULTY_ENV} ran out of device memory" in message
    assert "on_oom=skip_env_epoch" in message and "last.ckpt" in message
    _assert_checkpoint_kept(tmp_path, keep)


@pytest.mark.slow
def test_out_of_memory_can_skip_that_envs_epoch_and_go_on(tmp_path: Path) -> None:
    keep = KeepWeights()
    module = _fit(tmp_path, [keep, _InjectOOM()], on_oom="skip_env_epoch")
    assert module.current_epoch == 3  # every update ran
    skips = [e for s in keep.steps for e in s.events if e.kind == "oom_skip"]
    assert [e.env for e in skips] == [FAULTY_ENV]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


# ----------------------------------------------------------------- callbacks
class _Exploding(EsperCallback):
    def on_env_step(self, trainer, pl_module, step) -> None:  # type: ignore[no-untyped-def]
        if pl_module.current_epoch == FAULTY_UPDATE:
            raise KeyError("telemetry sink went away")


@pytest.mark.slow
def test_a_failing_callback_ends_the_run_naming_it_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    keep = KeepWeights()
    with pytest.raises(RunFailure) as caught:
        _fit(tmp_path, [keep, _Exploding()])
    message = str(caught.value)
    assert "_Exploding.on_env_step raised KeyError" in message
    assert "last.ckpt" in message
    _assert_checkpoint_kept(tmp_path, keep)
