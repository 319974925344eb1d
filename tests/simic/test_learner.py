"""``learner_device``: the PPO update trains a copy of the policy on another device."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from esper.contracts.config_errors import ConfigError
from esper.simic.learner import LearnerCopy, check_learner_run
from esper.simic.module import PPOModule
from tests.mdp.envs import small_data
from tests.simic.recorded_fit import recorded_fit
from tests.trainers import quiet_trainer


def _fit(
    root: Path,
    learner_device: str | None,
    max_epochs: int = 2,
    ckpt_path: str | None = None,
    stop_after: int | None = None,
    accelerator: str = "cpu",
) -> tuple[PPOModule, list[float]]:
    return recorded_fit(
        root, max_epochs, ckpt_path, stop_after, accelerator, learner_device=learner_device
    )


def _assert_same_weights(a: PPOModule, b: PPOModule) -> None:
    state = b.state_dict()
    for name, value in a.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_a_learner_copy_on_the_policys_device_trains_it_bit_for_bit(tmp_path: Path) -> None:
    """On one device the copy runs the same operators on the same values: the same run."""
    plain, plain_returns = _fit(tmp_path / "plain", None)
    copied, copied_returns = _fit(tmp_path / "copied", "cpu")

    assert copied_returns == plain_returns
    _assert_same_weights(plain, copied)
    learner = copied._learner
    assert plain._learner is None and isinstance(learner, LearnerCopy)
    # The optimizer steps the copy's parameters, not the acting policy's ...
    stepped = {id(p) for g in copied.optimizers().param_groups for p in g["params"]}  # type: ignore[union-attr]
    assert stepped == {id(p) for p in learner.policy.parameters()}
    assert not stepped & {id(p) for p in copied.policy.parameters()}  # type: ignore[union-attr]
    # ... whose trained weights the acting policy holds after each update.
    for mine, theirs in zip(learner.policy.parameters(), copied.policy.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(mine, theirs)
    # Not a submodule: checkpoints hold the policy once.
    assert not any(name.startswith("_learner") for name in copied.state_dict())


@pytest.mark.slow
def test_a_run_with_a_learner_copy_resumes_exactly_with_or_without_one(tmp_path: Path) -> None:
    """The optimizer's state is the copy's; a checkpoint carries it to a resumed run, which
    pulls the policy's loaded weights into its copy before its first update."""
    straight, straight_returns = _fit(tmp_path / "straight", "cpu", max_epochs=3)
    _, first = _fit(tmp_path / "split", "cpu", max_epochs=3, stop_after=2)
    assert len(first) == 2
    for learner_device in ("cpu", None):
        root = tmp_path / f"resumed_{learner_device}"
        shutil.copytree(tmp_path / "split", root)  # each resumes from update 2's checkpoint
        resumed, rest = _fit(root, learner_device, max_epochs=3, ckpt_path="last")
        assert first + rest == straight_returns, learner_device
        _assert_same_weights(straight, resumed)


def test_a_learner_device_torch_does_not_know_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"model\.learner_device: must name a device.*'gpu'"):
        PPOModule(learner_device="gpu")


def test_a_learner_copy_needs_one_process_at_full_precision() -> None:
    cpu = torch.device("cpu")
    check_learner_run(None, 4, "bf16-mixed")  # no copy: nothing to refuse
    check_learner_run(cpu, 1, "32-true")
    with pytest.raises(ConfigError, match=r"model\.learner_device: needs one process.*2"):
        check_learner_run(cpu, 2, "32-true")
    with pytest.raises(ConfigError, match=r"needs --trainer\.precision 32-true.*'bf16-mixed'"):
        check_learner_run(cpu, 1, "bf16-mixed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")
def test_a_learner_device_this_machine_cannot_use_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"model\.learner_device: names cuda:0, which this"):
        check_learner_run(torch.device("cuda:0"), 1, "32-true")


def test_a_fit_at_another_precision_with_a_learner_copy_stops_before_training(
    tmp_path: Path,
) -> None:
    module = PPOModule(
        n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]}, learner_device="cpu"
    )
    trainer = quiet_trainer(tmp_path, precision="bf16-mixed")
    with pytest.raises(ConfigError, match="precision"):
        trainer.fit(module, datamodule=small_data())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hosts_and_policy_on_the_gpu_learn_through_a_copy_on_the_cpu(tmp_path: Path) -> None:
    module, returns = _fit(tmp_path, "cpu", accelerator="gpu")
    assert len(returns) == 2
    assert module.policy is not None and module._learner is not None
    assert all(p.device.type == "cuda" for p in module.policy.parameters())
    assert all(p.device.type == "cpu" for p in module._learner.policy.parameters())
    state = module.optimizers().optimizer.state  # type: ignore[union-attr]
    assert state and all(
        t.device.type == "cpu" for s in state.values() for t in s.values() if torch.is_tensor(t)
    )
    for mine, theirs in zip(
        module._learner.policy.parameters(), module.policy.parameters(), strict=True
    ):
        assert torch.equal(mine, theirs.cpu())
