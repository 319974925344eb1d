"""The scalars one PPO update logs about its rollout (``train/*``, ``perf/*``, ``governor/*``).

docs/metrics.md explains each; the summary they come from was read once, at the end of
the rollout, so nothing here touches the device.
"""

from __future__ import annotations

import numpy as np

from esper.contracts.rollout import RolloutSummary

#: Shown on Lightning's progress bar, one update per tick.
PROGRESS_BAR_METRICS: frozenset[str] = frozenset(
    {"perf/env_steps_per_s", "train/episode_return", "train/host_val_acc"}
)


def rollout_metrics(summary: RolloutSummary) -> dict[str, float]:
    """The scalars ``PPOModule`` logs for one rollout, from its summary (host-side arrays)."""
    outside = 1.0 - summary.seconds_training_hosts / summary.seconds
    return {
        "train/episode_return": float(np.mean(summary.episode_return)),
        "train/host_val_acc": float(np.mean(summary.final_val_acc)),
        "train/seeds_germinated": float(np.mean(summary.seeds_germinated)),
        "train/seeds_fossilized": float(np.mean(summary.seeds_fossilized)),
        "train/seeds_pruned": float(np.mean(summary.seeds_pruned)),
        "train/params_added": float(np.mean(summary.params_added)),
        "perf/env_steps_per_s": summary.env_steps_per_s,
        # Counted by the loop, not measured: TelemetryCallback(profile="debug") logs
        # the measured perf/host_reads_per_step over the same denominator.
        "perf/packed_transfers_per_step": summary.packed_transfers / summary.host_epochs_per_env,
        "perf/fraction_outside_host_training": outside,
        "perf/stacked_share": summary.stacked_share,
        "governor/rollbacks": float(summary.rollbacks.sum()),
        "governor/discarded_transitions": float(summary.discarded_transitions.sum()),
    }
