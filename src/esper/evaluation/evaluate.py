"""Does growth pay off? A checkpoint's learned policy against the controls, on fresh hosts.

This module loads a checkpoint (its policy, normaliser, env settings and data module)
and hands the learned policy to ``esper.evaluation.comparison``, which runs it beside the
controls a researcher asks for (the grown networks trained from the start, a plain
network of equal size, a fixed schedule, random growth, no growth) on paired episodes
and tabulates test accuracy, parameters and training compute. The learned policy acts
on each head's most likely choice, or samples (``sample=True``): the stochastic policy
PPO trained. Episodes run side by side in groups as large as a training host's paired
group (else the run's ``n_envs``), so each host gets as much of every batch as in
training.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from esper.callbacks.checkpoint import CheckpointError, EsperCheckpointIO
from esper.contracts.evaluation import DEFAULT_CONTROLLERS, DEFAULT_GROWER, TUNING_SEEDS
from esper.evaluation.comparison import (
    ControllerResult,
    ControllerSpec,
    Evaluation,
    check_controllers,
    compare,
)
from esper.heap import freed_memory_kept
from esper.mdp.env_config import EnvConfig, action_schema
from esper.simic.checkpoint_contents import (
    DATA_KEY,
    ENVS_PER_RANK_KEY,
    check_same_action_space,
    checkpoint_policy_spec,
)
from esper.simic.module import PPOModule
from esper.tolaria.data.base import HostDataModule

__all__ = [
    "ControllerResult",
    "Evaluation",
    "evaluate",
    "evaluation_config",
    "load_datamodule",
    "load_module",
]


def load_datamodule(checkpoint: dict[str, Any], path: Path) -> HostDataModule:
    """Rebuild the host data module a checkpoint was trained on."""
    spec = checkpoint.get(DATA_KEY)
    if spec is None:
        raise CheckpointError(
            f"checkpoint {path} does not name its data module (no {DATA_KEY!r}); it was "
            "written by an older esper: pass the data module to evaluate() yourself"
        )
    module_name, _, class_name = spec["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} was trained on data module {spec['class_path']}, which cannot "
            f"be imported here ({type(exc).__name__}: {exc}); install the package that "
            "provides it"
        ) from exc
    return cls(**spec["init_args"])


def load_module(path: Path) -> tuple[PPOModule, dict[str, Any]]:
    """A PPOModule with the checkpoint's hyperparameters, policy and normaliser."""
    checkpoint = EsperCheckpointIO().load_checkpoint(path)
    checkpoint_policy_spec(checkpoint, path)  # not PPOModule's: say so before building one
    accepted = inspect.signature(PPOModule.__init__).parameters
    # LightningCLI adds its own entries (e.g. "_instantiator") beside the module's arguments.
    hparams = {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if k in accepted}
    try:
        module = PPOModule(**hparams)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} holds settings this esper does not accept ({exc}); "
            "evaluate it with the esper version that wrote it"
        ) from exc
    module.on_load_checkpoint(checkpoint)
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint {path} holds weights that do not fit its own policy spec "
            f"({str(exc).splitlines()[0]}); the file is damaged"
        ) from exc
    return module, checkpoint


def evaluate(
    ckpt: Path | str,
    episodes: int = 8,
    seed: int = TUNING_SEEDS.start,
    device: str = "cpu",
    datamodule: HostDataModule | None = None,
    controllers: tuple[str, ...] = DEFAULT_CONTROLLERS,
    sample: bool = False,
    on_controller_done: Callable[[ControllerResult], None] | None = None,
    grower: str = DEFAULT_GROWER,
) -> Evaluation:
    """Run ``episodes`` fresh episodes under each controller; see the module docstring.

    ``seed`` is an evaluation seed: its episodes are shared with no other seed, and it
    lies in the tuning or the reporting range (``esper.evaluation.episodes``). ``sample``
    draws the learned policy's actions from its distribution (seeded by the episode
    group, so a repeat gives the same episodes) instead of taking each head's most
    likely choice; the other controllers are unaffected. ``grower`` names the grower
    whose final networks the static controls copy. ``on_controller_done`` is called with
    each controller's result as soon as its episodes are done (progress).
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be an int >= 1, got {episodes!r}")
    check_controllers(controllers, grower)
    path = Path(ckpt)
    module, checkpoint = load_module(path)
    data = datamodule or load_datamodule(checkpoint, path)
    config = evaluation_config(module, _envs_per_rank(checkpoint, module, path))
    assert module.policy is not None and module.normalizer is not None
    check_same_action_space(module.policy.schema, action_schema(config, data), path)
    policy = module.policy.to(device).eval()
    learned = ControllerSpec(
        make=lambda env: policy,
        # Only the policy learned in normalised units; the others read raw features.
        normalize=module.normalizer.to(device),
        deterministic=not sample,
        policy_threads=module.policy_config.cpu_threads,
    )
    with freed_memory_kept():  # hosts train as in a fit (esper.heap)
        return compare(
            config,
            data,
            controllers,
            episodes=episodes,
            seed=seed,
            device=device,
            specs={"learned": learned},
            grower=grower,
            on_controller_done=on_controller_done,
        )


def evaluation_config(module: PPOModule, envs_per_rank: int | None = None) -> EnvConfig:
    """The run's env config, with as many envs side by side as trained on one data share.

    A training host trained on 1/n of every batch, n being its paired group's size, or
    the envs on its rank when unpaired (``envs_per_rank``, which the checkpoint records:
    a DDP run splits ``model.n_envs`` over its ranks; None for a checkpoint from before
    it did, taken as one rank). Evaluation runs unpaired groups of that n, so each
    evaluated host trains on as much data as the policy's hosts did.
    """
    config = replace(module.env_config, devices=None)
    n = config.n_envs if envs_per_rank is None else envs_per_rank
    n = module.ppo_config.pairing.group(n) or n
    return replace(config, n_envs=n)


def _envs_per_rank(checkpoint: dict[str, Any], module: PPOModule, path: Path) -> int | None:
    """The envs each training rank ran, as the checkpoint records them (None: not recorded)."""
    value = checkpoint.get(ENVS_PER_RANK_KEY)
    n_envs = module.env_config.n_envs
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or n_envs % value:
        raise CheckpointError(
            f"checkpoint {path} records {ENVS_PER_RANK_KEY}={value!r}, which does not divide "
            f"its model.n_envs={n_envs} into ranks; the file is damaged"
        )
    return value
