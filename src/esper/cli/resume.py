"""``esper fit --ckpt_path``: which checkpoint, whether it can resume this run, and where.

Lightning reads a checkpoint's hyperparameters with a bare ``torch.load`` and would resume
a finished run to do nothing; these checks run first, so a bad, foreign or finished
checkpoint is named in one line (a :class:`CheckpointError`) before any folder is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from esper.contracts import ActionSchema

#: Where the policy's weights sit in a checkpoint's state dict (``PPOModule.policy``).
POLICY_PREFIX = "policy."

#: ``--ckpt_path`` words that Lightning resolves itself rather than naming a file.
LIGHTNING_CKPT_WORDS = frozenset({"last", "best", "hpc"})


class Resume(NamedTuple):
    """The checkpoint a run resumes from: its path, the action space and observation size
    its policy was built for, and the shape of each policy parameter it holds."""

    path: str
    schema: ActionSchema
    obs_dim: int
    policy_shapes: dict[str, tuple[int, ...]]


def read_resume(run_config: Any) -> Resume | None:
    """The checkpoint ``run_config["ckpt_path"]`` names, read and checked; None when the
    run starts afresh (or Lightning resolves the word itself).

    ``last`` is resolved here, not by Lightning: the newest last.ckpt of the runs under the
    root, whose run folder this run then continues; ``run_config`` then names that file.
    """
    from esper.callbacks.checkpoint import CheckpointError, find_last_checkpoint, read_checkpoint
    from esper.simic.checkpoint_contents import checkpoint_policy_spec

    ckpt_path = run_config.get("ckpt_path")
    if str(ckpt_path) == "last":
        root = Path(run_config["trainer"].get("default_root_dir") or ".")
        found = find_last_checkpoint(root)
        if found is None:
            raise CheckpointError(
                f"--ckpt_path last: no run under {root.absolute()} has a last.ckpt "
                "(looked in */*/checkpoints and checkpoints); pass the .ckpt path, "
                "set --trainer.default_root_dir to the folder the run was in, or "
                "start afresh without --ckpt_path"
            )
        ckpt_path = run_config["ckpt_path"] = str(found)
    if not ckpt_path or str(ckpt_path) in LIGHTNING_CKPT_WORDS:
        return None
    if str(ckpt_path).startswith("registry"):
        raise CheckpointError(
            f"--ckpt_path {ckpt_path}: esper resumes from files only; pass a .ckpt path or `last`"
        )
    checkpoint = read_checkpoint(ckpt_path)
    schema, obs_dim = checkpoint_policy_spec(checkpoint, ckpt_path)
    _refuse_finished(checkpoint, str(ckpt_path), run_config["trainer"].get("max_epochs"))
    shapes = {
        name.removeprefix(POLICY_PREFIX): tuple(value.shape)
        for name, value in checkpoint.get("state_dict", {}).items()
        if name.startswith(POLICY_PREFIX)
    }
    return Resume(str(ckpt_path), schema, obs_dim, shapes)


def _refuse_finished(checkpoint: dict[str, Any], name: str, max_epochs: int | None) -> None:
    """A run that already made its ``max_epochs`` updates would resume to do nothing; say
    so, and how to train further."""
    from esper.callbacks.checkpoint import CheckpointError

    done = int(checkpoint.get("epoch", -1)) + 1
    if max_epochs is not None and 0 <= max_epochs <= done:
        raise CheckpointError(
            f"--ckpt_path {name}: this run already made its {done} PPO update(s) "
            f"(trainer.max_epochs={max_epochs}); to train it further, resume with "
            f"--trainer.max_epochs {done + max(done, 1)} (or any number above {done})"
        )


def check_resume_fits(resume: Resume | None, model: Any, datamodule: Any) -> None:
    """Refuse a checkpoint with another action space before the Trainer is built."""
    from esper.mdp.env_config import action_schema
    from esper.simic.checkpoint_contents import check_same_action_space
    from esper.tolaria.data import HostDataModule

    if resume is None or not isinstance(datamodule, HostDataModule):
        return
    try:
        run = action_schema(model.env_config, datamodule)
    except (ValueError, TypeError):
        return  # a bad host or blueprint setting: setup names it by its key
    check_same_action_space(resume.schema, run, resume.path)
    _check_same_policy(resume, model)


def _check_same_policy(resume: Resume, model: Any) -> None:
    """Refuse a checkpoint whose policy has other parameters than this run's settings
    build (another ``model.policy``), naming them, before Lightning fails on its state."""
    import torch

    from esper.callbacks.checkpoint import CheckpointError
    from esper.tamiyo.policy import PolicyNetwork

    with torch.random.fork_rng(devices=[]):  # a throwaway build draws nothing of the run's
        built = PolicyNetwork(resume.obs_dim, resume.schema, model.policy_config)
    wanted = {name: tuple(p.shape) for name, p in built.state_dict().items()}
    if wanted == resume.policy_shapes:
        return
    differ = sorted(
        name
        for name in wanted.keys() | resume.policy_shapes.keys()
        if wanted.get(name) != resume.policy_shapes.get(name)
    )
    raise CheckpointError(
        f"--ckpt_path {resume.path}: its policy does not fit this run's model.policy "
        f"settings (parameters that differ: {differ}); the checkpoint's hyperparameters do "
        "not describe its weights, so it was written by another esper version or edited"
    )


def resumed_run_logger(resume: Resume | None, config: dict[str, Any]) -> Any:
    """The logger that continues the resumed run's folder (one TensorBoard run, one
    events.jsonl, checkpoints where they were), or None to keep the configured one.

    Only in place of the default logger: one the user configured decides for itself, and a
    checkpoint outside a run folder starts a new folder.
    """
    from esper.callbacks.checkpoint import run_folder_of

    if resume is None or config.get("logger") not in (None, True):
        return None
    run = run_folder_of(Path(resume.path))
    if run is None:
        return None
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=run.save_dir, name=run.name, version=run.version)
