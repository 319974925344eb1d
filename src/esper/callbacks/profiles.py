"""Telemetry profiles: how much the event log and the metrics collect.

One profile name configures both halves of the telemetry:
:class:`~esper.callbacks.events.EventLogCallback` (the JSONL event log ``events.jsonl``)
and :class:`~esper.callbacks.metrics.MetricsCallback` (scalars through every configured
Lightning logger, histograms through a TensorBoard logger).
:class:`~esper.callbacks.telemetry.TelemetryCallback` passes its profile to both.

=========== ================================ =================================== ===================
profile     event log (``EventLogCallback``) metrics (``MetricsCallback``)       cost per env step
=========== ================================ =================================== ===================
``minimal`` kinds ``germinated``,            none                                a few Python ops
            ``fossilized``, ``pruned``,
            ``rollback``, ``ppo_update``,
            ``episode_end`` (and
            ``resume``); cumulative
            per-blueprint counts
``normal``  every kind                       once per rollout:                   a few numpy
                                             ``reward/<component>`` and          reductions and
                                             ``reward/total``,                   list appends
                                             ``stages/<STAGE>``,
                                             ``blueprints/<name>/<kind>``
                                             ``[_total]``,
                                             ``actions/<head>`` histograms
                                             and ``actions/op_rate/<OP>``
                                             (every ``histogram_every``
                                             rollouts), ``masks/<head>``,
                                             ``host/val_acc/env<i>``,
                                             ``lifecycle/refused``,
                                             ``lifecycle/illegal``,
                                             ``lifecycle/rollbacks``,
                                             ``lifecycle/discarded_transitions``
``debug``   every kind; the file is flushed  ``normal`` plus                     ``normal`` + two
            after every step                 ``debug/reward_step`` and           scalar writes, a
                                             ``debug/val_acc_step`` per env      file flush, and
                                             step (at step ``rollout * T +       every tensor op
                                             step``, ``T`` decisions per         through a
                                             episode);                           ``HostReadCounter``
                                             ``perf/host_reads_per_step``
                                             once per rollout, measured
=========== ================================ =================================== ===================

Scalars go to every logger in ``trainer.loggers`` (TensorBoard, CSV, MLflow, W&B, ...) at
the rollout index (the PPO update index) as the step; the ``actions/<head>`` histograms
need a ``TensorBoardLogger`` and are skipped without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from esper.contracts.rollout import EVENT_KINDS

PROFILE_MINIMAL = "minimal"
PROFILE_NORMAL = "normal"
PROFILE_DEBUG = "debug"

#: Lifecycle kinds whose per-blueprint counts are kept (cumulative, in ``state_dict``).
BLUEPRINT_KINDS: tuple[str, ...] = ("germinated", "fossilized", "pruned")


@dataclass(frozen=True)
class TelemetryProfile:
    """What one profile collects (see the module docstring's table)."""

    #: Event log: JSONL record kinds written.
    kinds: frozenset[str]
    #: Event log: flush ``events.jsonl`` after every env step.
    flush_every_step: bool
    #: Metrics: accumulate per step and log the rollout's summaries at its end.
    metrics: bool
    #: Metrics: log per-step ``debug/*`` scalars.
    per_step: bool
    #: Metrics: count host reads over each rollout and log ``perf/host_reads_per_step``.
    host_reads: bool = False


PROFILES: dict[str, TelemetryProfile] = {
    PROFILE_MINIMAL: TelemetryProfile(
        kinds=frozenset({*BLUEPRINT_KINDS, "rollback", "ppo_update", "episode_end", "resume"}),
        flush_every_step=False,
        metrics=False,
        per_step=False,
    ),
    PROFILE_NORMAL: TelemetryProfile(
        kinds=frozenset({*EVENT_KINDS, "ppo_update", "episode_end", "resume"}),
        flush_every_step=False,
        metrics=True,
        per_step=False,
    ),
    PROFILE_DEBUG: TelemetryProfile(
        kinds=frozenset({*EVENT_KINDS, "ppo_update", "episode_end", "resume"}),
        flush_every_step=True,
        metrics=True,
        per_step=True,
        host_reads=True,
    ),
}


def check_profile(owner: str, profile: object) -> TelemetryProfile:
    """The profile named ``profile``; ValueError naming ``owner`` and the known names if none."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(
            f"{owner}(profile={profile!r}) is not a known profile; "
            f"use one of {', '.join(repr(p) for p in PROFILES)}"
        )
    return PROFILES[profile]


__all__ = [
    "BLUEPRINT_KINDS",
    "PROFILES",
    "PROFILE_DEBUG",
    "PROFILE_MINIMAL",
    "PROFILE_NORMAL",
    "TelemetryProfile",
    "check_profile",
]
