"""Telemetry: a JSONL event log and TensorBoard summaries of every rollout.

:class:`TelemetryCallback` watches the rollout hooks of :class:`EsperCallback` and writes
two things into the run directory (``trainer.log_dir``; ``trainer.default_root_dir`` when
there is no logger):

* ``events.jsonl``: one JSON object per line, appended, for what happened to seeds and
  envs (germinated, refused with its reason, pruned, rolled back, ...), each PPO update
  and each env's episode end. ``grep``/``jq``/``pandas.read_json(lines=True)`` read it.
* TensorBoard summaries through the trainer's ``TensorBoardLogger`` (skipped silently for
  other loggers), written once per rollout from host-side accumulators, with the rollout
  index as the step.

How much is collected is a *profile* (:data:`PROFILES`):

=========== =========================================================== ====================
profile     collects                                                    cost per env step
=========== =========================================================== ====================
``minimal`` JSONL kinds ``germinated``, ``fossilized``, ``pruned``,     a few Python ops
            ``rollback``, ``ppo_update``, ``episode_end`` (and
            ``resume``); cumulative per-blueprint counts; no
            TensorBoard
``normal``  JSONL of every kind; TensorBoard once per rollout:          a few numpy
            ``reward/<component>`` and ``reward/total``,                reductions and
            ``stages/<STAGE>``, ``blueprints/<name>/<kind>[_total]``,   list appends
            ``actions/<head>`` histograms (every ``histogram_every``
            rollouts) and ``actions/op_rate/<OP>``, ``masks/<head>``,
            ``host/val_acc/env<i>``, ``lifecycle/refused``,
            ``lifecycle/illegal``, ``lifecycle/rollbacks``,
            ``lifecycle/discarded_transitions``
``debug``   ``normal`` plus ``debug/reward_step`` and                   ``normal`` + two
            ``debug/val_acc_step`` per env step (at step                scalar writes, a
            ``rollout * T + step``, ``T`` decisions per episode); the   file flush, and
            JSONL file is flushed after every step;                     every tensor op
            ``perf/host_reads_per_step`` once per rollout, measured     through a
            (see below)                                                 ``HostReadCounter``
=========== =========================================================== ====================

Every hook reads only the host-side :class:`StepBatch`/:class:`RolloutSummary` it is given
(numpy arrays, Python numbers), never a device tensor, so the rollout stays sync-free.
Under DDP only global rank 0 writes (its own envs); other ranks do nothing.

``perf/host_reads_per_step`` (``debug`` only) is a measurement, where the module's
``perf/packed_transfers_per_step`` is a count the rollout loop keeps by construction: a
:class:`~esper.host_reads.HostReadCounter` is entered at ``on_rollout_start`` and exited at
``on_rollout_end``, so it sees every host read of a tensor value in between (the rollout
loop, env steps, the policy, the buffer, and every callback's ``on_env_step``). Divided by
host epochs per env like the packed figure, it is written to TensorBoard with the other
rollout scalars. The two agree when the one packed transfer per host epoch is the only
read; a larger figure means something syncs the device, and
:attr:`TelemetryCallback.last_host_reads` ``.report()`` says where. Only ``debug`` pays for
the counter (a Python hook on every tensor op); it is exited on an exception and at
teardown as well, so it never outlives the fit. Dynamo runs no compiled code under a
dispatch mode, so with ``compile=True`` a ``debug`` rollout acts and trains eagerly: measure
there, time elsewhere.

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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from esper.callbacks.base import EsperCallback
from esper.contracts.actions import HEAD_NAMES
from esper.contracts.ops import LifecycleOp
from esper.contracts.rollout import EVENT_KINDS, LifecycleEvent, RolloutSummary, StepBatch
from esper.contracts.stages import SeedStage
from esper.host_reads import HostReadCounter

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

PROFILE_MINIMAL = "minimal"
PROFILE_NORMAL = "normal"
PROFILE_DEBUG = "debug"

#: TensorBoard tag of the measured host reads per host epoch (``debug`` profile).
HOST_READS_TAG = "perf/host_reads_per_step"

#: Lifecycle kinds whose per-blueprint counts are kept (cumulative, in ``state_dict``).
BLUEPRINT_KINDS: tuple[str, ...] = ("germinated", "fossilized", "pruned")


@dataclass(frozen=True)
class TelemetryProfile:
    """What one profile collects (see the module docstring's table)."""

    #: JSONL record kinds written.
    kinds: frozenset[str]
    #: Accumulate per step and write TensorBoard summaries at each rollout end.
    tensorboard: bool
    #: Write per-step TensorBoard scalars and flush the event file after every step.
    per_step: bool
    #: Count host reads over each rollout and write ``perf/host_reads_per_step``.
    host_reads: bool = False


PROFILES: dict[str, TelemetryProfile] = {
    PROFILE_MINIMAL: TelemetryProfile(
        kinds=frozenset({*BLUEPRINT_KINDS, "rollback", "ppo_update", "episode_end", "resume"}),
        tensorboard=False,
        per_step=False,
    ),
    PROFILE_NORMAL: TelemetryProfile(
        kinds=frozenset({*EVENT_KINDS, "ppo_update", "episode_end", "resume"}),
        tensorboard=True,
        per_step=False,
    ),
    PROFILE_DEBUG: TelemetryProfile(
        kinds=frozenset({*EVENT_KINDS, "ppo_update", "episode_end", "resume"}),
        tensorboard=True,
        per_step=True,
        host_reads=True,
    ),
}

_STATE_VERSION = 1


class TelemetryCallback(EsperCallback):
    """Writes lifecycle events to a JSONL file and rollout summaries to TensorBoard.

    Args:
        profile: how much to collect: ``"minimal"``, ``"normal"`` or ``"debug"`` (see
            :data:`PROFILES` and the module docstring). ``"debug"`` also measures the host
            reads of each rollout and logs ``perf/host_reads_per_step``; the others do not
            pay for the counter.
        events_file: name of the JSONL file, relative to the run directory (an absolute
            path is used as given). Opened in append mode, so a resumed run continues it.
        histogram_every: write the action histograms every this many rollouts (they are
            the bulkiest summaries); ``1`` writes them every rollout.
    """

    def __init__(
        self,
        profile: str = PROFILE_NORMAL,
        events_file: str = "events.jsonl",
        histogram_every: int = 1,
    ) -> None:
        super().__init__()
        if profile not in PROFILES:
            raise ValueError(
                f"TelemetryCallback(profile={profile!r}) is not a known profile; "
                f"use one of {', '.join(repr(p) for p in PROFILES)}"
            )
        if not isinstance(events_file, str | os.PathLike) or not str(events_file).strip():
            raise ValueError(
                f"TelemetryCallback(events_file={events_file!r}) must be a non-empty file name, "
                "e.g. 'events.jsonl'"
            )
        if isinstance(histogram_every, bool) or not isinstance(histogram_every, int):
            raise TypeError(
                f"TelemetryCallback(histogram_every={histogram_every!r}) must be an int >= 1"
            )
        if histogram_every < 1:
            raise ValueError(
                f"TelemetryCallback(histogram_every={histogram_every}) must be >= 1; "
                "1 writes the action histograms every rollout"
            )
        self.profile = profile
        self.events_file = str(events_file)
        self.histogram_every = histogram_every
        self._profile = PROFILES[profile]
        self._kinds = self._profile.kinds
        self._tb = self._profile.tensorboard
        self._per_step = self._profile.per_step

        # Set by setup(): None = not set up, False = this rank does not write.
        self._enabled: bool | None = None
        self.events_path: Path | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None
        # The counter measuring the rollout in progress (debug profile only).
        self._counter: HostReadCounter | None = None
        #: The ``debug`` profile's counter of the last finished rollout; ``.report()``
        #: lists where each read came from. None in other profiles.
        self.last_host_reads: HostReadCounter | None = None

        # State that survives a resume (state_dict).
        self.events_written = 0
        self.events_by_kind: dict[str, int] = {}
        self.blueprint_counts: dict[str, dict[str, int]] = {}
        self.rollouts_seen = 0
        self.steps_per_rollout = 0
        self._resumed_from: int | None = None

        # Per-rollout state.
        self._rollout = 0
        self._host_epoch = 0
        self._reset_accumulators()

    # ----------------------------------------------------------------- Lightning
    @property
    def state_key(self) -> str:
        return self._generate_state_key(events_file=self.events_file)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # ``trainer.log_dir`` broadcasts from rank 0: every rank must ask for it.
        log_dir = trainer.log_dir
        run_dir = Path(log_dir if log_dir is not None else trainer.default_root_dir)
        self._enabled = bool(trainer.is_global_zero)
        if not self._enabled:
            return
        path = Path(self.events_file)
        self.events_path = path if path.is_absolute() else run_dir / path
        self._writer = _summary_writer(trainer) if self._tb else None

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

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # A rollout that raised never reaches on_rollout_end: end its counter here.
        self._stop_counting()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_counting()
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None
        self._writer = None
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
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise ValueError(
                f"TelemetryCallback state has version {version!r}, this code reads "
                f"{_STATE_VERSION}; resume with the esper version that wrote the checkpoint"
            )
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
        self._reset_accumulators()
        if self._profile.host_reads:
            self._stop_counting()  # a rollout that never ended must not stay counted
            self._counter = HostReadCounter()
            self._counter.__enter__()

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        if not self._check_enabled():
            return
        self._rollout = step.rollout
        self._host_epoch = step.host_epoch + 1
        if step.events:
            self._log_events(step)
        if self._tb:
            self._accumulate(step)
            if self._per_step:
                self._write_step_scalars(step, pl_module)
        if self._per_step:
            self._flush()

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        if not self._check_enabled():
            return
        # First, so that the reads counted are the rollout's, not this hook's own writes.
        counted = self._stop_counting()
        self._rollout = rollout.rollout
        if "episode_end" in self._kinds:
            self._log_episode_ends(rollout)
        if self._writer is not None:
            self._write_rollout_summaries(rollout)
            if counted is not None:
                reads_per_step = counted.count / rollout.host_epochs_per_env
                self._writer.add_scalar(HOST_READS_TAG, reads_per_step, rollout.rollout)
        if self._max_step >= 0:
            self.steps_per_rollout = max(self.steps_per_rollout, self._max_step + 1)
        self.rollouts_seen = max(self.rollouts_seen, rollout.rollout + 1)
        self._flush()
        self._reset_accumulators()

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

    # -------------------------------------------------------------- host reads
    def _stop_counting(self) -> HostReadCounter | None:
        """Exit the rollout's counter, if one is running; returns it (also ``last_host_reads``)."""
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        self.last_host_reads = counter
        return counter

    # ------------------------------------------------------------------ events
    def _check_enabled(self) -> bool:
        if self._enabled is None:
            raise RuntimeError(
                "TelemetryCallback was not set up: pass it to Trainer(callbacks=[...]) so "
                "Lightning calls its setup() before the rollout hooks"
            )
        return self._enabled

    def _log_events(self, step: StepBatch) -> None:
        kinds = self._kinds
        for event in step.events:
            kind = event.kind
            if kind in BLUEPRINT_KINDS:
                self._count_blueprint(event)
            if kind in kinds:
                self._write(self._event_record(event, step))

    def _count_blueprint(self, event: LifecycleEvent) -> None:
        name = event.blueprint or "unknown"
        cumulative = self.blueprint_counts.setdefault(name, {})
        cumulative[event.kind] = cumulative.get(event.kind, 0) + 1
        if self._tb:
            current = self._bp_rollout.setdefault(name, {})
            current[event.kind] = current.get(event.kind, 0) + 1

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
        n_envs = len(summary.episode_return)
        for env in range(n_envs):
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

    # ------------------------------------------------------------- TensorBoard
    def _reset_accumulators(self) -> None:
        self._n_steps = 0
        self._max_step = -1
        self._n_envs = 0
        self._reward_sums: dict[str, float] = {}
        self._reward_total = 0.0
        self._actions: list[np.ndarray] = []
        self._mask_sums: dict[str, float] = {}
        self._mask_counts: dict[str, int] = {}
        self._refused = 0
        self._illegal = 0
        self._last_stages: np.ndarray | None = None
        self._bp_rollout: dict[str, dict[str, int]] = {}

    def _accumulate(self, step: StepBatch) -> None:
        self._n_steps += 1
        self._max_step = max(self._max_step, step.step)
        self._n_envs = step.n_envs
        sums = self._reward_sums
        for name, values in step.reward_components.items():
            sums[name] = sums.get(name, 0.0) + float(np.sum(values))
        self._reward_total += float(np.sum(step.rewards))
        if step.rollout % self.histogram_every == 0:
            self._actions.append(step.actions)
        for head, rate in step.mask_rates.items():
            self._mask_sums[head] = self._mask_sums.get(head, 0.0) + float(rate)
            self._mask_counts[head] = self._mask_counts.get(head, 0) + 1
        self._refused += int(np.count_nonzero(step.refused))
        self._illegal += int(np.count_nonzero(step.illegal))
        if step.stages.size:
            self._last_stages = step.stages

    def _write_step_scalars(self, step: StepBatch, pl_module: LightningModule) -> None:
        if self._writer is None:
            return
        per_rollout = self._steps_per_rollout(pl_module)
        index = step.rollout * per_rollout + step.step
        self._writer.add_scalar("debug/reward_step", float(np.mean(step.rewards)), index)
        self._writer.add_scalar("debug/val_acc_step", float(np.mean(step.val_acc)), index)

    def _steps_per_rollout(self, pl_module: LightningModule) -> int:
        """Decisions per episode: the env's own count, else the one seen in earlier rollouts."""
        env = getattr(pl_module, "env", None)
        count = getattr(env, "decisions_per_episode", None)
        if isinstance(count, int) and count > 0:
            return count
        return self.steps_per_rollout

    def _write_rollout_summaries(self, summary: RolloutSummary) -> None:
        writer, index = self._writer, summary.rollout
        n_envs = max(self._n_envs or len(summary.episode_return), 1)
        # Sum over the episode of the per-step mean over envs.
        for name, value in self._reward_sums.items():
            writer.add_scalar(f"reward/{name}", value / n_envs, index)
        if self._n_steps:
            writer.add_scalar("reward/total", self._reward_total / n_envs, index)

        if self._last_stages is not None:
            counts = np.bincount(
                self._last_stages.astype(np.int64).ravel(), minlength=len(SeedStage)
            )
            for stage in SeedStage:
                writer.add_scalar(f"stages/{stage.name}", int(counts[stage]), index)

        for name in sorted(self.blueprint_counts):
            current = self._bp_rollout.get(name, {})
            total = self.blueprint_counts[name]
            for kind in BLUEPRINT_KINDS:
                writer.add_scalar(f"blueprints/{name}/{kind}", current.get(kind, 0), index)
                writer.add_scalar(f"blueprints/{name}/{kind}_total", total.get(kind, 0), index)

        if self._actions:
            actions = np.concatenate(self._actions, axis=0)
            for column, head in enumerate(HEAD_NAMES[: actions.shape[1]]):
                values = actions[:, column]
                edges = np.arange(-0.5, int(values.max()) + 1.5)
                writer.add_histogram(f"actions/{head}", values, index, bins=edges)
            ops = np.bincount(actions[:, 0].astype(np.int64), minlength=len(LifecycleOp)) / len(
                actions
            )
            for op in LifecycleOp:
                writer.add_scalar(f"actions/op_rate/{op.name}", float(ops[op]), index)

        for head, total_rate in self._mask_sums.items():
            writer.add_scalar(f"masks/{head}", total_rate / self._mask_counts[head], index)

        for env, acc in enumerate(summary.final_val_acc):
            writer.add_scalar(f"host/val_acc/env{env}", float(acc), index)

        if self._n_steps:
            writer.add_scalar("lifecycle/refused", self._refused, index)
            writer.add_scalar("lifecycle/illegal", self._illegal, index)
        writer.add_scalar("lifecycle/rollbacks", int(np.sum(summary.rollbacks)), index)
        writer.add_scalar(
            "lifecycle/discarded_transitions", int(np.sum(summary.discarded_transitions)), index
        )


def _summary_writer(trainer: Trainer) -> Any:
    """The SummaryWriter of the trainer's first TensorBoard logger, or None."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.tensorboard import SummaryWriter

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            experiment = logger.experiment
            if isinstance(experiment, SummaryWriter):
                return experiment
    return None


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


__all__ = [
    "BLUEPRINT_KINDS",
    "HOST_READS_TAG",
    "PROFILES",
    "PROFILE_DEBUG",
    "PROFILE_MINIMAL",
    "PROFILE_NORMAL",
    "TelemetryCallback",
    "TelemetryProfile",
]
