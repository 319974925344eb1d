"""The event log: what happened to seeds, envs and the policy, one JSON object per line.

:class:`EventLogCallback` watches the rollout hooks of :class:`EsperCallback` and appends
to ``events.jsonl`` in the run directory (``trainer.log_dir``; ``trainer.default_root_dir``
when there is no logger) what happened to seeds and envs (germinated, refused with its
reason, pruned, rolled back, ...), each PPO update and each env's episode end.
``grep``/``jq``/``pandas.read_json(lines=True)`` read it; ``esper report`` plots it. Which
kinds it writes is the profile's (:mod:`esper.callbacks.profiles`): ``minimal`` keeps the
key kinds, ``normal`` all, ``debug`` all and flushes the file after every env step.

Every hook reads only the host-side :class:`StepBatch`/:class:`RolloutSummary` it is given
(numpy arrays, Python numbers), never a device tensor, so the rollout stays sync-free.
Under DDP only global rank 0 writes (its own envs); other ranks do nothing.

Event schema (every line has ``kind``, ``rollout``, ``host_epoch`` and ``time``, the Unix
time of writing; non-finite floats are written as ``null``):

* lifecycle kinds (:data:`~esper.contracts.rollout.EVENT_KINDS`: ``germinated``,
  ``advanced``, ``fossilized``, ``refused``, ``pruned``, ``cooldown``, ``rollback``,
  ``snapshot``): ``step``, ``env``, ``slot``, ``stage_from``, ``stage_to``, ``blueprint``,
  ``reason`` (the fields of :class:`~esper.contracts.rollout.LifecycleEvent`).
* ``ppo_update``: ``metrics``, the dict handed to ``on_ppo_update_end``.
* ``episode_end`` (one per env): ``env``, ``episode_return``, ``final_val_acc``,
  ``params_added``, ``seeds_germinated``, ``seeds_fossilized``, ``seeds_pruned``,
  ``rollbacks``, ``discarded_transitions``.
* ``resume``: written once when a run resumes from a checkpoint that carried this
  callback's state; ``events_written`` is the count at that checkpoint. Resumed in its
  own run folder, the run first drops from the file the records of the rollouts it is
  about to repeat (``rollout >=`` this line's, from the update under way when it
  stopped); ``dropped_unfinished`` says how many, so each rollout appears once.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from esper.callbacks.base import EsperCallback, check_state_version
from esper.callbacks.profiles import BLUEPRINT_KINDS, PROFILE_NORMAL, check_profile
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer

_STATE_VERSION = 1


def check_events_file(owner: str, events_file: object) -> str:
    """``events_file`` as a string; ValueError naming ``owner`` if it is not a file name."""
    if not isinstance(events_file, str | os.PathLike) or not str(events_file).strip():
        raise ValueError(
            f"{owner}(events_file={events_file!r}) must be a non-empty file name, "
            "e.g. 'events.jsonl'"
        )
    return str(events_file)


class EventLogCallback(EsperCallback):
    """Appends lifecycle events, PPO updates and episode ends to a JSONL file.

    Args:
        profile: which kinds to write: ``"minimal"``, ``"normal"`` or ``"debug"`` (see
            :mod:`esper.callbacks.profiles`); ``"debug"`` also flushes after every step.
        events_file: name of the JSONL file, relative to the run directory (an absolute
            path is used as given). Opened in append mode, so a resumed run continues it.
    """

    def __init__(self, profile: str = PROFILE_NORMAL, events_file: str = "events.jsonl") -> None:
        super().__init__()
        name = type(self).__name__
        self.profile = profile
        self.events_file = check_events_file(name, events_file)
        config = check_profile(name, profile)
        self._kinds = config.kinds
        self._flush_every_step = config.flush_every_step

        # Set by setup(): None = not set up, False = this rank does not write.
        self._enabled: bool | None = None
        self.events_path: Path | None = None
        self._file: IO[str] | None = None

        # State that survives a resume (state_dict).
        self.events_written = 0
        self.events_by_kind: dict[str, int] = {}
        self.blueprint_counts: dict[str, dict[str, int]] = {}
        self.rollouts_seen = 0
        self.steps_per_rollout = 0
        self._resumed_from: int | None = None

        # Where the rollout under way is.
        self._rollout = 0
        self._host_epoch = 0
        self._max_step = -1

    # ----------------------------------------------------------------- Lightning
    @property
    def state_key(self) -> str:
        return self._generate_state_key(events_file=self.events_file)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # ``trainer.log_dir`` broadcasts from rank 0: every rank must ask for it.
        log_dir = trainer.log_dir
        run_dir = Path(log_dir if log_dir is not None else trainer.default_root_dir)
        path = Path(self.events_file)
        self.events_path = path if path.is_absolute() else run_dir / path
        for other in _event_logs(trainer.callbacks):
            if other is not self and other.events_path == self.events_path:
                raise ValueError(
                    f"two callbacks write {self.events_path}: TelemetryCallback holds an "
                    "EventLogCallback of its own, so enable 'telemetry' or an "
                    "EventLogCallback, not both (or give each its own events_file)"
                )
        self._enabled = bool(trainer.is_global_zero)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Runs after a checkpoint's callback state was restored (load_state_dict).
        if self._enabled and self._resumed_from is not None:
            dropped = self._drop_unfinished_rollouts()
            self._write(
                {
                    "kind": "resume",
                    "rollout": self.rollouts_seen,
                    "host_epoch": 0,
                    "events_written": self._resumed_from,
                    "dropped_unfinished": dropped,
                }
            )
            self._resumed_from = None
            self._flush()

    def _drop_unfinished_rollouts(self) -> int:
        """Remove from the events file what rollouts the checkpoint does not hold wrote.

        A run resumed in its own folder appends to the events.jsonl it wrote before; the
        records of the update that was under way when it stopped (rollout index
        ``rollouts_seen`` on) describe a rollout the resumed run does again. They are
        dropped, so each rollout appears once; the ``resume`` record says how many.
        """
        assert self.events_path is not None, "setup() resolves the path on rank 0"
        if not self.events_path.is_file():
            return 0
        kept, dropped = [], 0
        with self.events_path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the crash
                    dropped += 1
                    continue
                if record.get("rollout", -1) >= self.rollouts_seen:
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            tmp = self.events_path.with_name(self.events_path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.events_path)
        return dropped

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None
        self._enabled = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "events_written": self.events_written,
            "events_by_kind": dict(self.events_by_kind),
            "blueprint_counts": {bp: dict(c) for bp, c in self.blueprint_counts.items()},
            "rollouts_seen": self.rollouts_seen,
            "steps_per_rollout": self.steps_per_rollout,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_version(type(self).__name__, state_dict, _STATE_VERSION)
        self.events_written = int(state_dict["events_written"])
        self.events_by_kind = {k: int(v) for k, v in state_dict["events_by_kind"].items()}
        self.blueprint_counts = {
            bp: {k: int(v) for k, v in counts.items()}
            for bp, counts in state_dict["blueprint_counts"].items()
        }
        self.rollouts_seen = int(state_dict["rollouts_seen"])
        self.steps_per_rollout = int(state_dict["steps_per_rollout"])
        self._resumed_from = self.events_written

    # ------------------------------------------------------------ rollout hooks
    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        if not self._check_enabled():
            return
        self._rollout = rollout
        self._max_step = -1

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        if not self._check_enabled():
            return
        self._rollout = step.rollout
        self._host_epoch = step.host_epoch + 1
        if step.step > self._max_step:
            self._max_step = step.step
        if step.events:
            self._log_events(step)
        if self._flush_every_step:
            self._flush()

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        if not self._check_enabled():
            return
        self._rollout = rollout.rollout
        if "episode_end" in self._kinds:
            self._log_episode_ends(rollout)
        if self._max_step >= 0:
            self.steps_per_rollout = max(self.steps_per_rollout, self._max_step + 1)
        self._max_step = -1
        self.rollouts_seen = max(self.rollouts_seen, rollout.rollout + 1)
        self._flush()

    def on_ppo_update_end(
        self, trainer: Trainer, pl_module: LightningModule, metrics: dict[str, float]
    ) -> None:
        if not self._check_enabled():
            return
        if "ppo_update" in self._kinds:
            self._write(
                {
                    "kind": "ppo_update",
                    "rollout": self._rollout,
                    "host_epoch": self._host_epoch,
                    "metrics": dict(metrics),
                }
            )
        self._flush()

    # ------------------------------------------------------------------ events
    def _check_enabled(self) -> bool:
        if self._enabled is None:
            raise RuntimeError(
                f"{type(self).__name__} was not set up: pass it to Trainer(callbacks=[...]) "
                "so Lightning calls its setup() before the rollout hooks"
            )
        return self._enabled

    def _log_events(self, step: StepBatch) -> None:
        kinds = self._kinds
        for event in step.events:
            kind = event.kind
            if kind in BLUEPRINT_KINDS:
                counts = self.blueprint_counts.setdefault(event.blueprint or "unknown", {})
                counts[kind] = counts.get(kind, 0) + 1
            if kind in kinds:
                self._write(self._event_record(event, step))

    def _event_record(self, event: LifecycleEvent, step: StepBatch) -> dict[str, Any]:
        return {
            "kind": event.kind,
            "rollout": step.rollout,
            "host_epoch": event.host_epoch or step.host_epoch,
            "step": step.step,
            "env": event.env,
            "slot": event.slot,
            "stage_from": event.stage_from,
            "stage_to": event.stage_to,
            "blueprint": event.blueprint,
            "reason": event.reason,
        }

    def _log_episode_ends(self, summary: RolloutSummary) -> None:
        for env in range(len(summary.episode_return)):
            self._write(
                {
                    "kind": "episode_end",
                    "rollout": summary.rollout,
                    "host_epoch": self._host_epoch,
                    "env": env,
                    "episode_return": summary.episode_return[env],
                    "final_val_acc": summary.final_val_acc[env],
                    "params_added": summary.params_added[env],
                    "seeds_germinated": summary.seeds_germinated[env],
                    "seeds_fossilized": summary.seeds_fossilized[env],
                    "seeds_pruned": summary.seeds_pruned[env],
                    "rollbacks": _at(summary.rollbacks, env),
                    "discarded_transitions": _at(summary.discarded_transitions, env),
                }
            )

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            assert self.events_path is not None, "setup() resolves the path on rank 0"
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: each record reaches the OS when written, so a crash of this
            # process loses nothing; flush() at rollout end is the explicit guarantee.
            self._file = open(self.events_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        record["time"] = time.time()
        self._file.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self.events_written += 1
        kind = record["kind"]
        self.events_by_kind[kind] = self.events_by_kind.get(kind, 0) + 1

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()


def _event_logs(callbacks: list[Callback]) -> list[EventLogCallback]:
    """The event logs among ``callbacks``, those a callback holds as ``parts`` included."""
    found = []
    for callback in callbacks:
        for part in getattr(callback, "parts", (callback,)):
            if isinstance(part, EventLogCallback):
                found.append(part)
    return found


def _at(values: np.ndarray, index: int) -> Any:
    """``values[index]``, or 0 where the array was left empty (no governor)."""
    return values[index] if index < len(values) else 0


def _jsonable(value: Any) -> Any:
    """``value`` with numpy scalars/arrays as Python types and non-finite floats as None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


__all__ = ["EventLogCallback", "check_events_file"]
