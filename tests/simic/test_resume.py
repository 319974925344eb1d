"""Checkpoints: an interrupted run resumes exactly; bad files give clear errors."""

from __future__ import annotations

import collections
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from esper.callbacks.checkpoint import CheckpointError, EsperCheckpointIO, default_checkpoints
from esper.simic.module import PPOModule
from esper.simic.ppo import PPOConfig
from tests.mdp.envs import small_data
from tests.simic.recorded_fit import EPISODE_EPOCHS, recorded_fit
from tests.tolaria.stacking import count_stacked_steps
from tests.trainers import quiet_trainer


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["per_env", "stacked"])
def test_resume_continues_exactly_where_the_run_stopped(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either engine: the stacked one keeps nothing between epochs but the envs' own
    tensors, so a checkpoint between updates holds all it needs."""
    stacked_steps = count_stacked_steps(monkeypatch)
    straight, straight_returns = recorded_fit(tmp_path / "straight", 3, engine=engine)
    _, first_returns = recorded_fit(tmp_path / "split", 3, stop_after=2, engine=engine)
    assert len(first_returns) == 2, "the interrupted run must stop after two updates"
    assert (tmp_path / "split" / "checkpoints" / "last.ckpt").is_file()
    resumed, resumed_returns = recorded_fit(tmp_path / "split", 3, "last", engine=engine)

    assert first_returns + resumed_returns == straight_returns
    assert bool(stacked_steps) == (engine == "stacked")  # the engine ran where asked
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_a_best_policy_copy_is_kept_beside_last(tmp_path: Path) -> None:
    recorded_fit(tmp_path, 2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "last.ckpt" in names
    assert any(n.startswith("best-") for n in names), names


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    io = EsperCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)

    class Unpicklable:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed mid-save"):
        io.save_checkpoint({"state_dict": {}, "x": Unpicklable()}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left


def test_ctrl_c_during_a_save_lands_once_the_checkpoint_is_written(tmp_path: Path) -> None:
    """A KeyboardInterrupt raised inside ``torch.save`` could leave its zip writer
    mid-record and end the run with a RuntimeError instead of the interrupt."""
    path = tmp_path / "last.ckpt"

    class PressesCtrlC:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGINT)  # Python's handler runs at once
            return (collections.OrderedDict, ())  # what a safe load takes

    with pytest.raises(KeyboardInterrupt):
        EsperCheckpointIO().save_checkpoint(
            {"state_dict": {"w": torch.ones(4)}, "x": PressesCtrlC()}, path
        )
    written = EsperCheckpointIO().load_checkpoint(path)
    assert written["x"] == {} and torch.equal(written["state_dict"]["w"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_truncated_checkpoint_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    EsperCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(64)}}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"last\.ckpt could not be read"):
        EsperCheckpointIO().load_checkpoint(path)


def test_a_missing_checkpoint_is_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        EsperCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_a_checkpoint_from_another_setup_is_refused_with_the_difference(tmp_path: Path) -> None:
    recorded_fit(tmp_path, 1)
    L.seed_everything(0, verbose=False)
    other = PPOModule(n_envs=2, episode_epochs=EPISODE_EPOCHS, host_kwargs={"channels": [4, 8, 8]})
    trainer = quiet_trainer(tmp_path, 2)
    with pytest.raises(CheckpointError, match="slots"):
        trainer.fit(
            other, datamodule=small_data(), ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt")
        )


def test_configs_passed_as_dataclasses_save_as_plain_mappings_and_rebuild(tmp_path: Path) -> None:
    from esper.evaluation.evaluate import load_module
    from esper.kasmina import LifecycleConfig

    L.seed_everything(0, verbose=False)
    module = PPOModule(
        n_envs=2,
        episode_epochs=EPISODE_EPOCHS,
        host_kwargs={"channels": [4, 8]},
        ppo=PPOConfig(lr=1e-3),
        lifecycle=LifecycleConfig(min_training_epochs=1),
    )
    trainer = quiet_trainer(tmp_path, callbacks=default_checkpoints(), enable_checkpointing=True)
    trainer.fit(module, datamodule=small_data())
    path = tmp_path / "checkpoints" / "last.ckpt"

    hparams = torch.load(path, weights_only=True)["hyper_parameters"]
    assert hparams["ppo"]["lr"] == 1e-3 and hparams["lifecycle"]["min_training_epochs"] == 1
    rebuilt, _ = load_module(path)
    assert rebuilt.ppo_config == PPOConfig(lr=1e-3)
    assert rebuilt.env_config.lifecycle == LifecycleConfig(min_training_epochs=1)


def test_a_config_mapping_with_an_unknown_field_names_its_key() -> None:
    from esper.contracts.config_errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.ppo: has no field\(s\) \['learning_rate'\]"):
        PPOModule(ppo={"learning_rate": 1e-3})  # type: ignore[arg-type]


def test_the_checkpoint_io_refuses_an_unsafe_load(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    EsperCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    with pytest.raises(CheckpointError, match="weights_only=True only"):
        EsperCheckpointIO().load_checkpoint(path, weights_only=False)
