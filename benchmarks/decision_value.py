"""What one decision is worth against the noise, from the training events of paired runs.

For every training episode in the given ``events.jsonl`` files (written by ``esper fit``'s
event log), the env's final validation accuracy, in points, is fitted by least squares on
the episode's counts of fossilized seeds per blueprint, prunes and germinations, and the
host epoch of its first fossilization (25 when none), every column taken less its mean
over the paired group (the rollout's envs, which started from the same host and saw the
same data). It prints each coefficient with its standard error and the standard
deviation of what the counts leave unexplained: the signal a policy gets per decision,
and the noise it gets with it.

Usage: ``python benchmarks/decision_value.py 'runs/*/seed*/lightning_logs/version_0/events.jsonl'``
(one rollout per paired group: runs with ``model.n_envs`` at most ``model.ppo.pair_size``).
"""

from __future__ import annotations

import argparse
import glob
import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

#: Percentage points per unit of accuracy.
POINTS = 100.0
#: Host epoch recorded for an episode that fossilized nothing (the default episode length).
NO_FOSSIL_EPOCH = 25


@dataclass
class Episode:
    """One training episode's outcome and the decisions counted in it."""

    rollout: int
    final_points: float
    fossilized: Counter[str] = field(default_factory=Counter)  # per blueprint
    pruned: int = 0
    germinated: int = 0
    first_fossil_epoch: int = NO_FOSSIL_EPOCH


def read_episodes(path: str) -> list[Episode]:
    """The episodes that ended in one ``events.jsonl``."""
    episodes: dict[tuple[int, int], Episode] = {}
    with open(path) as f:
        for line in f:
            event = json.loads(line)
            kind = event["kind"]
            if kind not in ("fossilized", "germinated", "pruned", "episode_end"):
                continue
            key = (event["rollout"], event["env"])
            episode = episodes.setdefault(key, Episode(rollout=key[0], final_points=np.nan))
            if kind == "fossilized":
                episode.fossilized[event["blueprint"]] += 1
                episode.first_fossil_epoch = min(episode.first_fossil_epoch, event["host_epoch"])
            elif kind == "germinated":
                episode.germinated += 1
            elif kind == "pruned":
                episode.pruned += 1
            else:
                episode.final_points = event["final_val_acc"] * POINTS
    return [e for e in episodes.values() if not np.isnan(e.final_points)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", help="glob of events.jsonl files (quote it)")
    args = parser.parse_args()
    paths = sorted(glob.glob(args.pattern))
    if not paths:
        raise SystemExit(f"no events.jsonl files match {args.pattern!r}")
    runs = [read_episodes(p) for p in paths]
    for path, episodes in zip(paths, runs, strict=True):
        print(f"{path}: {len(episodes)} episodes")
    names = sorted({bp for episodes in runs for e in episodes for bp in e.fossilized})
    data = [
        [run, e.rollout, e.final_points]
        + [e.fossilized[bp] for bp in names]
        + [e.pruned, e.germinated, e.first_fossil_epoch]
        for run, episodes in enumerate(runs)
        for e in episodes
    ]
    table = np.asarray(data, dtype=float)
    # Within each paired group (a run's rollout), every column less its group mean: the
    # policy is paid relative to its group, and a count not centred the same way would be
    # credited with only (group - 1) / group of its worth.
    groups = np.unique(table[:, :2], axis=0, return_inverse=True)[1].reshape(-1)
    values = table[:, 2:]
    sums = np.zeros((groups.max() + 1, values.shape[1]))
    np.add.at(sums, groups, values)
    sizes = np.bincount(groups)[:, None]
    centred = values - (sums / sizes)[groups]
    y, design = centred[:, 0], centred[:, 1:]
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise SystemExit(
            "the counts are collinear over these episodes (e.g. every germinated seed was "
            "fossilized or pruned, or a count never varies): no per-decision worth to fit"
        )
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = len(y) - design.shape[1] - len(sizes)
    cov = (resid @ resid / dof) * np.linalg.inv(design.T @ design)
    labels = [f"fossilized {bp}" for bp in names] + [
        "pruned",
        "germinated",
        "first fossil epoch",
    ]
    print(f"{len(y)} episodes; deviation from the paired mean: sd {y.std(ddof=1):.2f} pts")
    for label, c, se in zip(labels, coef, np.sqrt(np.diag(cov)), strict=True):
        print(f"  {label:<24} {c:+.3f} ± {se:.3f} pts")
    print(f"unexplained: sd {np.sqrt(resid @ resid / dof):.2f} pts per episode")


if __name__ == "__main__":
    main()
