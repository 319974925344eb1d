"""Checkpoints that a run can always resume from.

:class:`EsperCheckpoint` writes every update's state to ``last.ckpt`` (so
``esper fit --ckpt_path last`` resumes) and :class:`BestPolicyCheckpoint` keeps the best
policy so far, by ``train/episode_return``, beside it. Their folder is the run's own,
``<log_dir>/checkpoints`` (``lightning_logs/version_N/checkpoints``), as with Lightning's
``ModelCheckpoint``; without a logger it is ``<default_root_dir>/checkpoints``.
:func:`find_last_checkpoint` is what ``--ckpt_path last`` means: the newest ``last.ckpt``
of any run under a root folder, and :func:`run_folder_of` names the run folder a
checkpoint belongs to, so that a resumed run continues it.

:class:`EsperCheckpointIO` reads and writes them. Writes go to a temporary file that is
renamed over the target only once complete, so a kill during a save leaves the previous
checkpoint intact, and a Ctrl-C during a save lands once the save is done. Reads
(:func:`read_checkpoint`) are safe loads (``weights_only=True``), and a file that cannot
be read raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from esper.sigint import python_handles_sigint

#: The metric that decides which policy is "best".
DEFAULT_MONITOR = "train/episode_return"
CHECKPOINT_DIR = "checkpoints"


#: What to do about an unusable checkpoint, in the words of the command that read it:
#: ``esper fit`` resumes from a file (``--ckpt_path``), ``esper evaluate`` reads one
#: (``--ckpt``). The key is a :class:`CheckpointError`'s ``advice``.
ADVICE: dict[str, dict[str, str]] = {
    "missing": {
        "fit": "pass an existing .ckpt file or `--ckpt_path last` to resume from the newest "
        "last.ckpt",
        "evaluate": "pass an existing .ckpt file or `--ckpt last` for the newest run's last.ckpt",
    },
    "another_file": {
        "fit": "resume from another file (best-*.ckpt beside it, or an earlier copy) or start "
        "afresh without --ckpt_path",
        "evaluate": "evaluate another file (best-*.ckpt beside it, or an earlier copy)",
    },
    "action_space": {
        "fit": "resume with the same host, data and blueprints (--model.blueprints lists "
        "them), or start afresh without --ckpt_path",
        "evaluate": "evaluate it where the blueprints it was trained with are registered "
        "(the same plugins installed; `esper plugins` lists them)",
    },
}
#: The command whose words a :class:`CheckpointError` uses unless told another.
DEFAULT_COMMAND = "fit"


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable or belongs to a different run setup.

    ``reason`` says what is wrong with the file; ``advice`` (a key of :data:`ADVICE`, or
    None) what to do, which depends on the command: ``str()`` gives ``esper fit``'s words,
    :meth:`for_command` another command's.
    """

    def __init__(self, reason: str, advice: str | None = None) -> None:
        if advice is not None and advice not in ADVICE:
            raise ValueError(f"advice must be one of {list(ADVICE)} or None, got {advice!r}")
        self.reason = reason
        self.advice = advice
        super().__init__(self.for_command(DEFAULT_COMMAND))

    def for_command(self, command: str) -> str:
        """The message with the advice ``esper COMMAND`` gives."""
        if self.advice is None:
            return self.reason
        return f"{self.reason}; {ADVICE[self.advice][command]}"


class EsperCheckpointIO(TorchCheckpointIO):
    """Atomic ``torch.save`` (temp file + fsync + rename) and loads with clear errors."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"EsperCheckpointIO does not take storage_options, got {storage_options!r}"
            )
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _ctrl_c_after_the_write():
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if weights_only is False:
            raise CheckpointError(
                f"checkpoint {path}: EsperCheckpointIO loads with weights_only=True only, so "
                "that reading a checkpoint never runs code; esper's checkpoints hold nothing else"
            )
        return read_checkpoint(path, map_location=map_location)


@contextmanager
def _ctrl_c_after_the_write() -> Iterator[None]:
    """Ctrl-C while a checkpoint is written lands once it is written: the run then stops
    as Ctrl-C stops it, with this update's checkpoint whole.

    Raised inside ``torch.save``, the KeyboardInterrupt could cut a record short, and
    closing the zip writer then raised ``RuntimeError: ... unexpected pos`` in its place:
    the run ended with status 1 and that error, not 130 and how to resume (seen in a CI
    run of the Ctrl-C test). Only where Python's own SIGINT handler is installed and in
    the main thread (where handlers run); a program's own handler is left alone.
    """
    if not python_handles_sigint():
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


#: The class torch's safe loader refused, in its "Unsupported global" message.
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """Load a Lightning checkpoint with ``torch.load(weights_only=True)``.

    ``weights_only`` because a checkpoint may come from elsewhere and unpickling anything
    more can run code; esper writes tensors, plain containers and numbers only. Every way a
    file can be unusable raises :class:`CheckpointError` with a one-line message that names
    the file and what is wrong with it, so the CLI can show that line instead of a traceback.
    """
    file = Path(path)
    if not file.exists():
        raise CheckpointError(f"checkpoint {file} does not exist", "missing")
    if file.is_dir():
        raise CheckpointError(
            f"checkpoint {file} is a folder; pass a .ckpt file in it (e.g. {file / 'last.ckpt'})"
        )
    if file.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {file} is empty (0 bytes)", "another_file")
    try:
        checkpoint = torch.load(file, map_location=map_location or "cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _UNSUPPORTED_GLOBAL.search(str(exc))
        if refused is None:
            raise CheckpointError(
                f"checkpoint {file} is not a checkpoint, or is damaged ({_first_line(exc)})",
                "another_file",
            ) from exc
        raise CheckpointError(
            f"checkpoint {file} holds a {refused.group(1)} object, which a safe load refuses "
            "because unpickling it could run code; it was not written by this version of "
            "esper fit",
            "another_file",
        ) from exc
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {file} could not be read ({type(exc).__name__}: {_first_line(exc)}); "
            "it is truncated or not a checkpoint",
            "another_file",
        ) from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(
            f"checkpoint {file} holds no Lightning checkpoint (no 'state_dict' entry); "
            "pass a .ckpt file written by esper fit"
        )
    return checkpoint


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message: torch's can run to 20 lines."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class _RunFolderCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` in the run's folder whose ``last`` is the newest of any run.

    Lightning resolves ``ckpt_path="last"`` before the logger has picked this run's
    version, against a folder that does not exist yet; the ``last.ckpt`` a user means is
    the newest one of the earlier runs beside it.
    """

    def _fix_dirpath(self, trainer: Trainer) -> None:
        if self.dirpath is None:
            self.dirpath = str(run_checkpoint_dir(trainer))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._fix_dirpath(trainer)
        super().setup(trainer, pl_module, stage)

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        if self.dirpath is not None:
            return super()._find_last_checkpoints(trainer)
        found = find_last_checkpoint(Path(trainer.default_root_dir))
        return set() if found is None else {str(found)}


def run_checkpoint_dir(trainer: Trainer) -> Path:
    """``<log_dir>/checkpoints``: the run's own folder, or the root's without a logger."""
    log_dir = trainer.log_dir if trainer.loggers else None
    return Path(log_dir if log_dir is not None else trainer.default_root_dir) / CHECKPOINT_DIR


#: Where runs under a root keep ``last.ckpt``: ``<root>/<logger name>/<version>/checkpoints``
#: (a logger's run folder) and ``<root>/checkpoints`` (a run without a logger).
_LAST_PATTERNS = (f"*/*/{CHECKPOINT_DIR}/last.ckpt", f"{CHECKPOINT_DIR}/last.ckpt")


def find_last_checkpoint(root: Path) -> Path | None:
    """The most recently written ``last.ckpt`` of the runs under ``root``, or None."""
    found = [p for pattern in _LAST_PATTERNS for p in root.glob(pattern) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


@dataclass(frozen=True)
class RunFolder:
    """A logger's run folder, ``<save_dir>/<name>/<version>``."""

    save_dir: Path
    name: str
    version: str | int

    @property
    def path(self) -> Path:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return self.save_dir / self.name / version


def run_folder_of(checkpoint: Path) -> RunFolder | None:
    """The run folder ``checkpoint`` was written in, when it lies in one's ``checkpoints``.

    A run folder is one a logger made: it holds ``hparams.yaml``. A checkpoint copied
    anywhere else belongs to no run, and resuming from it starts a new run folder.
    """
    folder = checkpoint.absolute().parent
    run = folder.parent
    if folder.name != CHECKPOINT_DIR or not (run / "hparams.yaml").is_file():
        return None
    number = re.fullmatch(r"version_(\d+)", run.name)
    version: str | int = int(number.group(1)) if number else run.name
    return RunFolder(save_dir=run.parent.parent, name=run.parent.name, version=version)


class EsperCheckpoint(_RunFolderCheckpoint):
    """``last.ckpt`` after every PPO update, overwritten in place (atomically).

    Lightning's ``save_last`` only writes when a top-k file was written in the same step,
    so with a monitored metric that did not improve it would skip; saving the newest
    checkpoint *as* ``last.ckpt`` avoids that.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        for fixed in ("monitor", "filename", "save_top_k", "save_last"):
            if fixed in kwargs:
                raise ValueError(
                    f"EsperCheckpoint sets {fixed} itself; use BestPolicyCheckpoint or "
                    "lightning's ModelCheckpoint for other schemes"
                )
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            filename=ModelCheckpoint.CHECKPOINT_NAME_LAST,
            save_top_k=1,
            save_last=False,
            enable_version_counter=False,
            **kwargs,
        )


class BestPolicyCheckpoint(_RunFolderCheckpoint):
    """The best policy so far by ``monitor`` (default ``train/episode_return``, max)."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        monitor: str = DEFAULT_MONITOR,
        mode: str = "max",
        filename: str = "best-{epoch:03d}",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("save_top_k", 1)
        kwargs.setdefault("auto_insert_metric_name", False)
        super().__init__(dirpath=dirpath, monitor=monitor, mode=mode, filename=filename, **kwargs)


def newest_checkpoint(trainer: Trainer) -> Path | None:
    """The file a run resumes from: :class:`EsperCheckpoint`'s ``last.ckpt``, else the
    last file any other checkpoint callback wrote; None before the first one."""
    found: list[str] = []
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, EsperCheckpoint) and cb.best_model_path:
            return Path(cb.best_model_path)
        if isinstance(cb, ModelCheckpoint):
            found += [p for p in (cb.last_model_path, cb.best_model_path) if p]
    return Path(found[0]) if found else None


def default_checkpoints() -> list[ModelCheckpoint]:
    """What ``esper fit`` installs: keep the best policy, resume from ``last.ckpt``.

    Best first: each checkpoint holds the callbacks' state as of its own save, so
    ``last.ckpt`` written after the best one carries the best-so-far it has just decided,
    and a resumed run does not take a worse policy for the best.
    """
    return [BestPolicyCheckpoint(), EsperCheckpoint()]
