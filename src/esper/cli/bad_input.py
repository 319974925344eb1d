"""Bad input ends a command with one line naming it, not a traceback.

A wrong config value arrives as a :class:`~esper.contracts.config_errors.ConfigError`,
often wrapped by jsonargparse ("Does not validate against any of the Union subtypes"); the
error is found in the cause chain and put under its CLI key, so ``esper fit`` prints
``model.ppo.clip_coef: must be a finite number > 0, got -1.0``. A missing file or a bad
checkpoint is named the same way. Anything else is a genuine failure and keeps its
traceback.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from esper.contracts.config_errors import ConfigError

#: Exit status of a command refused for bad input (as argparse's own errors).
BAD_INPUT_STATUS = 2
#: Errors that mean the user's input (a path, a file) is wrong, not that Esper is.
INPUT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes and contexts, outermost first."""
    seen: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and all(link is not s for s in seen):
        seen.append(link)
        yield link
        link = link.__cause__ or link.__context__


def placed(error: ConfigError) -> ConfigError:
    """``error`` under its config's CLI key (``PPOConfig``'s ``clip_coef`` is
    ``model.ppo.clip_coef``); as it is when placed already or its owner has no key."""
    from esper.simic.validation import cli_key_of

    prefix = None if error.owner is None else cli_key_of(error.owner)
    return error if prefix is None else error.under(prefix)


def input_error(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that names bad input, or None for a genuine failure.

    The outermost ConfigError wins: whoever caught and re-raised one knew more about where
    the value sits.
    """
    from esper.callbacks.checkpoint import CheckpointError

    chain = list(exception_chain(exc))
    keyed = next((link for link in chain if isinstance(link, ConfigError)), None)
    if keyed is not None:
        return placed(keyed)
    return next(
        (link for link in chain if isinstance(link, (CheckpointError, *INPUT_ERRORS))), None
    )


def try_writing_in(folder: Path) -> None:
    """Make ``folder`` and a file in it, then remove what was made; the OSError if either
    fails. Why: a run or an evaluation may go on for hours and writes where it was told;
    a folder it cannot write in is bad input, said before any work (an evaluation wrote its
    results at the end and lost them all, in a traceback after the last episode)."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    finally:
        for path in made:
            path.rmdir()


#: The trainer's settings that choose its hardware, named when Lightning refuses them.
HARDWARE_SETTINGS: tuple[str, ...] = ("accelerator", "devices", "strategy", "num_nodes")


def refused_trainer(settings: Mapping[str, Any], exc: BaseException) -> ConfigError:
    """Lightning's refusal to build the trainer from ``settings`` (its keyword arguments)
    as a ConfigError: ``Trainer(accelerator="gpu")`` on a machine without one raised
    "No supported gpu backend found!" and ``esper fit`` printed a traceback. An accelerator
    that asks for a GPU torch cannot see is named as such; anything else keeps Lightning's
    words, beside the hardware settings it was given."""
    import torch

    accelerator = str(settings.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        return ConfigError(
            "trainer.accelerator",
            f"{accelerator!r} asks for a GPU, and torch {torch.__version__} finds none on "
            "this machine (torch.cuda.is_available() is False); use cpu, or auto (a GPU "
            "where there is one)",
        )
    given = ", ".join(f"{key}={settings[key]!r}" for key in HARDWARE_SETTINGS if key in settings)
    return ConfigError("trainer", f"Lightning refused the trainer ({given}): {exc}")


def one_line(error: BaseException, command: str = "fit") -> str:
    """``error``'s text on one line, whatever line breaks its source wrote; a checkpoint's
    error gives the advice of ``esper COMMAND`` (its flags and words)."""
    from esper.callbacks.checkpoint import CheckpointError

    text = error.for_command(command) if isinstance(error, CheckpointError) else str(error)
    return " ".join(text.split())


class RunFolderGuard:
    """Removes the run folder a failed start created, so bad input leaves nothing behind.

    Lightning creates ``lightning_logs/version_N`` (config.yaml, events) as the run sets
    up, before Esper can check a checkpoint against the data or the run's config as a
    whole; when such a check fails, the folder holds no result. A folder that existed
    before the run is never touched.
    """

    def __init__(self) -> None:
        self._created: list[Path] = []

    def watch(self, folders: Sequence[Path]) -> None:
        """Remember which of ``folders`` (outermost first) this run is about to create."""
        self._created = [f for f in folders if not f.exists()]

    def remove_created(self) -> None:
        for folder in reversed(self._created):
            if folder.is_dir():
                shutil.rmtree(folder)
