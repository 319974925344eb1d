"""What a checkpoint of ``esper fit`` holds beside weights, and how it is read back.

``PPOModule`` writes these entries; ``esper evaluate`` and a resumed ``esper fit`` read
them before any module exists (to rebuild the policy for the right action space, the data
module the run used, and refuse a checkpoint from another action space), so they live
apart from the module. Everything written is plain data, so checkpoints load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

from esper.callbacks.checkpoint import CheckpointError
from esper.contracts import ActionSchema, BlendMode
from esper.tolaria.data.base import HostDataModule

#: Checkpoint key holding what is needed to rebuild the policy before its weights load.
SPEC_KEY = "esper_policy_spec"
#: Checkpoint key naming the host data module and its arguments, for evaluation.
DATA_KEY = "esper_data"
#: Checkpoint key holding the random states and generators an exact resume needs.
RUN_STATE_KEY = "esper_run_state"
#: Checkpoint key holding the envs each rank ran (``model.n_envs`` over the world size):
#: evaluation gives its hosts the data share a training host had.
ENVS_PER_RANK_KEY = "esper_envs_per_rank"


def plain(value: Any) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` accepts.

    Dataclasses become dicts, paths strings and enums their values: the configs and data
    module arguments a checkpoint records, rebuilt from these plain forms on load.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    return value


def checkpoint_policy_spec(
    checkpoint: Mapping[str, Any], where: object
) -> tuple[ActionSchema, int]:
    """The action space and observation size the checkpoint's policy was built for.

    Raises :class:`CheckpointError` naming ``where`` (the file) when the checkpoint was not
    written by ``PPOModule`` or its spec is damaged.
    """
    spec = checkpoint.get(SPEC_KEY)
    if not isinstance(spec, Mapping):
        raise CheckpointError(
            f"checkpoint {where} has no {SPEC_KEY!r} entry: it was not written by esper fit "
            "(PPOModule); pass a .ckpt file that esper fit wrote"
        )
    try:
        schema = ActionSchema(
            tuple(spec["slot_ids"]),
            tuple(spec["blueprint_names"]),
            tuple(BlendMode(m) for m in spec["blend_modes"]),
        )
        obs_dim = int(spec["obs_dim"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {where} has a damaged {SPEC_KEY!r} entry ({type(exc).__name__}: {exc}); "
            "pass a .ckpt file that esper fit wrote"
        ) from exc
    return schema, obs_dim


def check_same_action_space(trained: ActionSchema, run: ActionSchema, where: object) -> None:
    """Refuse a checkpoint whose policy chooses among other slots or blueprints than this run.

    Its heads would be the wrong size (or, worse, the right size with other meanings): the
    usual cause is a plugin that added or removed blueprints since the checkpoint was written.
    """
    if trained == run:
        return
    diffs = []
    if trained.slot_ids != run.slot_ids:
        diffs.append(f"slots {list(trained.slot_ids)} (this run: {list(run.slot_ids)})")
    if trained.blueprint_names != run.blueprint_names:
        diffs.append(
            f"blueprints {list(trained.blueprint_names)} (this run: {list(run.blueprint_names)})"
        )
    if trained.blend_modes != run.blend_modes:
        diffs.append(
            f"blend modes {[m.name for m in trained.blend_modes]} "
            f"(this run: {[m.name for m in run.blend_modes]})"
        )
    raise CheckpointError(
        f"checkpoint {where} was trained with another action space: {'; '.join(diffs)}",
        "action_space",
    )


def policy_spec(obs_dim: int, schema: ActionSchema) -> dict[str, Any]:
    """The :data:`SPEC_KEY` entry: what rebuilding the policy needs before its weights load."""
    return {
        "obs_dim": obs_dim,
        "slot_ids": list(schema.slot_ids),
        "blueprint_names": list(schema.blueprint_names),
        "blend_modes": [int(m) for m in schema.blend_modes],
    }


def data_entry(datamodule: HostDataModule) -> dict[str, Any]:
    """The :data:`DATA_KEY` entry: the data module's class path and arguments."""
    return {
        "class_path": f"{type(datamodule).__module__}.{type(datamodule).__qualname__}",
        "init_args": plain(dict(getattr(datamodule, "init_args", {}))),
    }
