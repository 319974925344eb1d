"""Rollout metrics: reward components, stages, blueprints, actions, masks, host accuracy.

:class:`MetricsCallback` watches the rollout hooks of :class:`EsperCallback`, accumulates
host-side sums per env step and, once per rollout, logs scalars through Lightning's logger
API (``logger.log_metrics`` for every logger in ``trainer.loggers``), so TensorBoard, CSV,
MLflow, W&B or any other configured logger gets them, with the rollout index (the PPO
update index) as the step. The ``actions/<head>`` histograms are the only thing written
to TensorBoard's own writer, when the trainer has a ``TensorBoardLogger`` (skipped
otherwise). What is logged is the profile's (:mod:`esper.callbacks.profiles`):
``minimal`` logs nothing, ``normal`` the per-rollout summaries, ``debug`` also per-step
scalars and the measured host reads. ``docs/metrics.md`` lists every name.

Every hook reads only the host-side :class:`StepBatch`/:class:`RolloutSummary` it is given
(numpy arrays, Python numbers) and logs Python floats, never a device tensor, so the
rollout stays sync-free. Under DDP only global rank 0 logs (its own envs).

``perf/host_reads_per_step`` (``debug`` only) is a measurement, where the module's
``perf/packed_transfers_per_step`` is a count the rollout loop keeps by construction: a
:class:`~esper.host_reads.HostReadCounter` is entered at ``on_rollout_start`` and exited at
``on_rollout_end``, so it sees every host read of a tensor value in between (the rollout
loop, env steps, the policy, the buffer, and every callback's ``on_env_step``). Divided by
host epochs per env like the packed figure, it is logged with the other rollout scalars.
The two agree when the one packed transfer per host epoch is the only read; a larger
figure means something syncs the device, and :attr:`MetricsCallback.last_host_reads`
``.report()`` says where. Only ``debug`` pays for the counter (a Python hook on every
tensor op); it is exited on an exception and at teardown as well, so it never outlives
the fit. Dynamo runs no compiled code under a dispatch mode, so with ``compile=True`` a
``debug`` rollout acts and trains eagerly: measure there, time elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from esper.callbacks.base import EsperCallback, check_state_version
from esper.callbacks.profiles import BLUEPRINT_KINDS, PROFILE_NORMAL, check_profile
from esper.contracts.actions import HEAD_NAMES
from esper.contracts.ops import LifecycleOp
from esper.contracts.rollout import RolloutSummary, StepBatch
from esper.contracts.stages import SeedStage
from esper.host_reads import HostReadCounter

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

#: Name of the measured host reads per host epoch (``debug`` profile).
HOST_READS_TAG = "perf/host_reads_per_step"

_STATE_VERSION = 1


def check_histogram_every(owner: str, histogram_every: object) -> int:
    """``histogram_every`` if it is an int >= 1; TypeError/ValueError naming ``owner``."""
    if isinstance(histogram_every, bool) or not isinstance(histogram_every, int):
        raise TypeError(f"{owner}(histogram_every={histogram_every!r}) must be an int >= 1")
    if histogram_every < 1:
        raise ValueError(
            f"{owner}(histogram_every={histogram_every}) must be >= 1; "
            "1 writes the action histograms every rollout"
        )
    return histogram_every


class MetricsCallback(EsperCallback):
    """Logs each rollout's summaries to every configured Lightning logger.

    Args:
        profile: how much to log: ``"minimal"`` (nothing), ``"normal"`` or ``"debug"``
            (see :mod:`esper.callbacks.profiles`). ``"debug"`` also measures the host
            reads of each rollout and logs ``perf/host_reads_per_step``; the others do
            not pay for the counter.
        histogram_every: log the action histograms and op rates every this many
            rollouts (the histograms are the bulkiest summaries); ``1``: every rollout.
    """

    def __init__(self, profile: str = PROFILE_NORMAL, histogram_every: int = 1) -> None:
        super().__init__()
        name = type(self).__name__
        config = check_profile(name, profile)
        self.profile = profile
        self.histogram_every = check_histogram_every(name, histogram_every)
        self._logs_metrics = config.metrics
        self._per_step = config.per_step
        self._count_reads = config.host_reads

        # Set by setup(): None = not set up, False = nothing to log on this rank.
        self._enabled: bool | None = None
        self._loggers: list[Any] = []
        self._writer: Any = None
        # The counter measuring the rollout in progress (debug profile only).
        self._counter: HostReadCounter | None = None
        #: The ``debug`` profile's counter of the last finished rollout; ``.report()``
        #: lists where each read came from. None in other profiles.
        self.last_host_reads: HostReadCounter | None = None

        # State that survives a resume (state_dict).
        self.blueprint_totals: dict[str, dict[str, int]] = {}
        self.steps_per_rollout = 0

        self._reset_accumulators()

    # ----------------------------------------------------------------- Lightning
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for callback in trainer.callbacks:
            for part in getattr(callback, "parts", (callback,)):
                if (
                    isinstance(part, MetricsCallback)
                    and part is not self
                    and part._logs_metrics
                    and self._logs_metrics
                ):
                    raise ValueError(
                        "two MetricsCallbacks would log the same names (a TelemetryCallback "
                        "holds one of its own): enable one 'telemetry' or one "
                        "MetricsCallback, not both"
                    )
        # Without a logger the rollouts are still summed (and in ``debug`` their host reads
        # counted, for ``last_host_reads``); there is just nowhere to log them.
        self._loggers = list(trainer.loggers)
        self._enabled = bool(trainer.is_global_zero and self._logs_metrics)
        self._writer = _summary_writer(trainer) if self._enabled else None

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        # A rollout that raised never reaches on_rollout_end: end its counter here.
        self._stop_counting()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_counting()
        self._loggers = []
        self._writer = None
        self._enabled = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "blueprint_totals": {bp: dict(c) for bp, c in self.blueprint_totals.items()},
            "steps_per_rollout": self.steps_per_rollout,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_version(type(self).__name__, state_dict, _STATE_VERSION)
        self.blueprint_totals = {
            bp: {k: int(v) for k, v in counts.items()}
            for bp, counts in state_dict["blueprint_totals"].items()
        }
        self.steps_per_rollout = int(state_dict["steps_per_rollout"])

    # ------------------------------------------------------------ rollout hooks
    def on_rollout_start(self, trainer: Trainer, pl_module: LightningModule, rollout: int) -> None:
        if not self._check_enabled():
            return
        self._reset_accumulators()
        if self._count_reads:
            self._stop_counting()  # a rollout that never ended must not stay counted
            self._counter = HostReadCounter()
            self._counter.__enter__()

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        if not self._check_enabled():
            return
        self._accumulate(step)
        if self._per_step:
            index = step.rollout * self._decisions_per_episode(pl_module) + step.step
            self._log(
                {
                    "debug/reward_step": float(np.mean(step.rewards)),
                    "debug/val_acc_step": float(np.mean(step.val_acc)),
                },
                index,
            )

    def on_rollout_end(
        self, trainer: Trainer, pl_module: LightningModule, rollout: RolloutSummary
    ) -> None:
        if not self._check_enabled():
            return
        # First, so that the reads counted are the rollout's, not this hook's own writes.
        counted = self._stop_counting()
        scalars = self._rollout_scalars(rollout)
        if counted is not None:
            scalars[HOST_READS_TAG] = counted.count / rollout.host_epochs_per_env
        self._log(scalars, rollout.rollout)
        self._write_histograms(rollout.rollout)
        if self._max_step >= 0:
            self.steps_per_rollout = max(self.steps_per_rollout, self._max_step + 1)
        self._reset_accumulators()

    # -------------------------------------------------------------- host reads
    def _stop_counting(self) -> HostReadCounter | None:
        """Exit the rollout's counter, if one is running; returns it (also ``last_host_reads``)."""
        counter, self._counter = self._counter, None
        if counter is None:
            return None
        counter.__exit__(None, None, None)
        self.last_host_reads = counter
        return counter

    # ----------------------------------------------------------------- metrics
    def _check_enabled(self) -> bool:
        if self._enabled is None:
            raise RuntimeError(
                f"{type(self).__name__} was not set up: pass it to Trainer(callbacks=[...]) "
                "so Lightning calls its setup() before the rollout hooks"
            )
        return self._enabled

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self._loggers:
            logger.log_metrics(metrics, step)

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
        for event in step.events:
            if event.kind in BLUEPRINT_KINDS:
                name = event.blueprint or "unknown"
                for counts in (self.blueprint_totals, self._bp_rollout):
                    per_kind = counts.setdefault(name, {})
                    per_kind[event.kind] = per_kind.get(event.kind, 0) + 1

    def _decisions_per_episode(self, pl_module: LightningModule) -> int:
        """Decisions per episode: the env's own count, else the one seen in earlier rollouts."""
        env = getattr(pl_module, "env", None)
        count = getattr(env, "decisions_per_episode", None)
        if isinstance(count, int) and count > 0:
            return count
        return self.steps_per_rollout

    def _rollout_scalars(self, summary: RolloutSummary) -> dict[str, float]:
        """The rollout's scalars by name, from the accumulators and ``summary``."""
        out: dict[str, float] = {}
        n_envs = max(self._n_envs or len(summary.episode_return), 1)
        # Sum over the episode of the per-step mean over envs.
        for name, value in self._reward_sums.items():
            out[f"reward/{name}"] = value / n_envs
        if self._n_steps:
            out["reward/total"] = self._reward_total / n_envs

        if self._last_stages is not None:
            counts = np.bincount(
                self._last_stages.astype(np.int64).ravel(), minlength=len(SeedStage)
            )
            for stage in SeedStage:
                out[f"stages/{stage.name}"] = float(counts[stage])

        for name in sorted(self.blueprint_totals):
            current = self._bp_rollout.get(name, {})
            total = self.blueprint_totals[name]
            for kind in BLUEPRINT_KINDS:
                out[f"blueprints/{name}/{kind}"] = float(current.get(kind, 0))
                out[f"blueprints/{name}/{kind}_total"] = float(total.get(kind, 0))

        if self._actions:
            ops = np.concatenate(self._actions, axis=0)[:, 0].astype(np.int64)
            rates = np.bincount(ops, minlength=len(LifecycleOp)) / len(ops)
            for op in LifecycleOp:
                out[f"actions/op_rate/{op.name}"] = float(rates[op])

        for head, total_rate in self._mask_sums.items():
            out[f"masks/{head}"] = total_rate / self._mask_counts[head]

        for env, acc in enumerate(summary.final_val_acc):
            out[f"host/val_acc/env{env}"] = float(acc)

        if self._n_steps:
            out["lifecycle/refused"] = float(self._refused)
            out["lifecycle/illegal"] = float(self._illegal)
        out["lifecycle/rollbacks"] = float(np.sum(summary.rollbacks))
        out["lifecycle/discarded_transitions"] = float(np.sum(summary.discarded_transitions))
        return out

    def _write_histograms(self, index: int) -> None:
        """The ``actions/<head>`` histograms, through TensorBoard's writer when there is one."""
        if self._writer is None or not self._actions:
            return
        actions = np.concatenate(self._actions, axis=0)
        for column, head in enumerate(HEAD_NAMES[: actions.shape[1]]):
            values = actions[:, column]
            edges = np.arange(-0.5, int(values.max()) + 1.5)
            self._writer.add_histogram(f"actions/{head}", values, index, bins=edges)


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


__all__ = ["HOST_READS_TAG", "MetricsCallback", "check_histogram_every"]
