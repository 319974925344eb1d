"""What ``esper fit`` adds to LightningCLI's options: defaults, registry names, help order.

Each function is one adjustment, kept out of the LightningCLI subclass so the subclass
reads as the order in which a run is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

#: Callbacks ``esper fit`` enables by registry name unless ``--callbacks`` says otherwise.
DEFAULT_CALLBACKS: tuple[str, ...] = (
    "telemetry",
    "governor",
    "timeline",
    # best before last: last.ckpt then holds the best-so-far decided in the same update
    "best_checkpoint",
    "last_checkpoint",
)
#: Added to the callbacks when stdout is not a terminal, in place of the progress bar.
PLAIN_PROGRESS = "progress_lines"

#: Defaults for ``esper fit`` with no arguments: a short run on the embedded digits data.
DEFAULT_DATA = "esper.tolaria.data.DigitsDataModule"
DEFAULT_MAX_EPOCHS = 60
FIT_TRAINER_DEFAULTS: dict[str, object] = {
    "max_epochs": DEFAULT_MAX_EPOCHS,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}

#: Where Lightning's rank-zero messages go; its litlogger advert is one of them.
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"


def _drop_advert(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def quiet_third_party() -> None:
    """No adverts or deprecation notices of libraries in a normal run (they are not ours
    to act on): Lightning's litlogger tip, and torch's LeafSpec deprecation that
    Lightning's own pytree helper triggers."""
    logging.getLogger(LIGHTNING_INFO_LOGGER).addFilter(_drop_advert)
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
    )


def data_names_as_class_paths(argv: Sequence[str]) -> list[str]:
    """``--data NAME`` (and ``--data.help NAME``) with a registry name as its class path.

    LightningCLI takes a class path or a class name after ``--data``; Esper's registry
    names (``digits``, ``tokens``, a plugin's name; ``esper plugins`` lists them) work
    wherever those do.
    """
    from esper.tolaria.data import DATAMODULES

    def resolve(name: str) -> str:
        if name not in DATAMODULES:
            return name
        cls = DATAMODULES.get(name)
        return f"{cls.__module__}.{cls.__qualname__}"

    out = list(argv)
    for i, word in enumerate(out):
        option, eq, value = word.partition("=")
        if option not in ("--data", "--data.help"):
            continue
        if eq:
            out[i] = f"{option}={resolve(value)}"
        elif i + 1 < len(out):
            out[i + 1] = resolve(out[i + 1])
    return out


def data_keys_given(argv: Sequence[str]) -> set[str]:
    """Init args named on the command line (``--data.x`` or ``--data.init_args.x``)."""
    keys = set()
    for word in argv:
        if word.startswith("--data."):
            key = word[len("--data.") :].split("=", 1)[0]
            keys.add(key.removeprefix("init_args."))
    return keys


def drop_carried_defaults(data: Any, given: set[str]) -> None:
    """Reset init args that ``--data OtherClass`` carried over from the default data class.

    jsonargparse keeps the default class's init args when another class is chosen, if the
    new class accepts them (jsonargparse issue #460): ``--data TokenSequenceDataModule``
    would inherit the digits ``val_fraction``, which synthetic tokens refuse. An init arg
    equal to the default class's default, where the chosen class's own default differs,
    is taken as carried over and set back to the chosen class's default, unless the
    command line names it (``given``).
    """
    own = _init_defaults(_import_class(data["class_path"]))
    default = _init_defaults(_import_class(DEFAULT_DATA))
    init_args = data.get("init_args")
    if init_args is None:
        return
    for name in list(vars(init_args)):
        carried = name in own and name in default and init_args[name] == default[name] != own[name]
        if carried and name not in given:
            init_args[name] = own[name]


def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _init_defaults(cls: type) -> dict[str, Any]:
    return {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def record_resolved_configs(model_config: Any, module: Any) -> None:
    """Put the configs the run uses into the config LightningCLI saves (``config.yaml``),
    where a left-out config reads ``null``: the file then repeats the run by itself."""
    from jsonargparse import Namespace

    env = module.env_config
    resolved = {
        "lifecycle": env.lifecycle,
        "host_optim": env.optim,
        "rewards": env.rewards,
        "policy": module.policy_config,
        "ppo": module.ppo_config,
        "normalizer": module.normalizer_config,
    }
    for key, config in resolved.items():
        model_config[key] = Namespace(**dataclasses.asdict(config))
    model_config["host_kwargs"] = dict(env.host_kwargs)


def progress_bar(trainer_config: dict[str, Any]) -> list[Any]:
    """Esper's bar over host epochs where Lightning would show its own (one that counts
    the single batch of an update), unless the run brings a progress bar of its own."""
    from lightning.pytorch.callbacks import ProgressBar

    from esper.callbacks.progress import UpdateProgressBar

    given = trainer_config.get("callbacks") or []
    if not trainer_config.get("enable_progress_bar", True) or any(
        isinstance(cb, ProgressBar) for cb in given
    ):
        return []
    return [UpdateProgressBar()]


def with_checkpoint_io(plugins: Any) -> list[Any]:
    """The run's Trainer plugins, with :class:`EsperCheckpointIO` (atomic writes, safe
    loads, errors that name the file) unless the run brings a CheckpointIO of its own."""
    from lightning.fabric.plugins import CheckpointIO

    from esper.callbacks.checkpoint import EsperCheckpointIO

    given = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    if any(isinstance(plugin, CheckpointIO) for plugin in given):
        return given
    return [*given, EsperCheckpointIO()]


def trainer_group_after_esper_groups(parser: Any) -> None:
    """Show Esper's option groups (model, data) in ``--help`` before Lightning's long
    Trainer group, which LightningCLI adds first.

    Only the help changes: argparse prints groups in ``_action_groups`` order, while
    parsing, defaults and the saved config follow the parser's actions, and the Trainer
    group is not one the parser instantiates. Left as it is if the group is not there.
    """
    trainer = parser.groups.get("trainer")
    groups = parser._action_groups
    if trainer is not None and trainer in groups:
        groups.remove(trainer)
        groups.append(trainer)
