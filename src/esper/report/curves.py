"""Learning curves from a run's telemetry event log, and the ``esper report`` entry point.

:func:`render_learning_curve` reads the ``events.jsonl`` that
:class:`~esper.callbacks.telemetry.TelemetryCallback` writes and plots, per PPO update,
the mean episode return (top panel) and the host's validation accuracy at the end of the
episode (bottom panel; each env's value as a faint dot when the log has ``episode_end``
lines), each as a rolling mean with its 95% interval. Where the run was evaluated
(``esper evaluate`` writes ``evaluation/evaluation.json`` in the run folder), every
control's validation accuracy is drawn across the accuracy panel: the answer to "did the
policy learn to beat no growth?" is whether the green band ends above the grey one.

A resumed run appends to the same log: the ``resume`` line says from which rollout on
the lines repeat, so the lines of those rollouts written before it are dropped, and a
``ppo_update`` line for a rollout seen before replaces the earlier one.

:func:`report` finds every ``events.jsonl`` under a run directory (e.g.
``lightning_logs/version_0/events.jsonl``) and writes ``learning_curve.png`` beside each.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from esper.report.statistics import clustered_mean
from esper.report.timeline import check_size, figure_to_array, new_figure, write_png

#: Default ``(width, height)`` of a learning curve in pixels.
LEARNING_CURVE_SIZE: tuple[int, int] = (1000, 500)

#: Name of the telemetry event log :func:`report` looks for.
EVENTS_FILE = "events.jsonl"

#: Name of the picture :func:`report` writes beside each event log.
LEARNING_CURVE_FILE = "learning_curve.png"

#: Updates averaged for each point of the curves' lines and bands: an update's episodes
#: are a handful of hosts, so one update alone swings by a few points.
ROLLING_UPDATES = 5
#: The controller the curve itself shows; its evaluation row is not drawn as a control.
LEARNED = "learned"
#: Colours of the evaluated controls' bands, in the evaluation's order.
CONTROL_COLOURS = ("#7f7f7f", "#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#bcbd22")


class Band(NamedTuple):
    """A controller's mean and 95% interval, drawn across the accuracy panel."""

    mean: float
    low: float
    high: float


RETURN_KEY = "train/episode_return"
ACCURACY_KEY = "train/host_val_acc"


#: Where ``esper evaluate`` writes its figures by default, relative to the run folder.
EVALUATION_JSON = Path("evaluation") / "evaluation.json"


def render_learning_curve(
    events_jsonl: Path | str,
    path: Path | str | None = None,
    size: tuple[int, int] = LEARNING_CURVE_SIZE,
    controls: Mapping[str, Band] | None = None,
) -> np.ndarray:
    """Plot mean episode return and host accuracy over PPO updates from ``events_jsonl``.

    Updates are numbered from 1, as ``esper fit`` numbers them. Each panel shows the
    per-update mean faintly and, over it, the mean of the last :data:`ROLLING_UPDATES`
    updates with its 95% interval: each update's episodes are fresh hosts, so an update's
    mean is one independent unit, while envs of one update share a paired group's host.
    ``controls`` (controller name to its mean final validation accuracy and 95% interval,
    from an ``esper evaluate`` of the run: :func:`evaluated_controls`) are drawn across the
    accuracy panel as bands, the levels the policy's hosts are read against.

    Returns the picture as ``uint8`` RGB of shape ``(height, width, 3)`` and writes it as
    PNG to ``path`` when given. Raises ValueError naming the file when it holds no
    ``ppo_update`` line (or a line that is not JSON, other than a last line cut short by
    a crash).
    """
    width, height = check_size(size, "render_learning_curve")
    events_jsonl = Path(events_jsonl)
    updates, episodes = _read_log(events_jsonl)
    if not updates:
        raise ValueError(
            f"{events_jsonl} has no 'ppo_update' lines: no PPO update finished in this run, "
            "or the TelemetryCallback that wrote it left that kind out"
        )
    rollouts = sorted(updates)
    numbers = np.array(rollouts) + 1  # as the CLI prints them: update 1/N .. N/N
    returns = [_metric(updates[r], RETURN_KEY, episodes.get(r), "episode_return") for r in rollouts]
    accuracy = [
        _metric(updates[r], ACCURACY_KEY, episodes.get(r), "final_val_acc") for r in rollouts
    ]

    fig = new_figure(width, height)
    top, bottom = fig.subplots(2, 1, sharex=True)
    _draw_rolling(top, numbers, np.array(returns), "tab:blue")
    top.set_ylabel("episode return\n(mean over envs)")
    top.grid(True, alpha=0.3)
    top.set_title(
        f"{_run_name(events_jsonl)}: {len(rollouts)} PPO update(s); lines: mean of the last "
        f"{ROLLING_UPDATES} updates, bands: its 95% interval",
        fontsize="medium",
    )

    per_env = [
        (r + 1, _float(e.get("final_val_acc")))
        for r in rollouts
        for e in episodes.get(r, {}).values()
    ]
    if per_env:
        xs, ys = zip(*per_env, strict=True)
        bottom.scatter(xs, ys, s=5, color="tab:green", alpha=0.2, linewidths=0, label="per env")
    _draw_rolling(bottom, numbers, np.array(accuracy), "tab:green", label="learned (training)")
    for i, (name, band) in enumerate((controls or {}).items()):
        colour = CONTROL_COLOURS[i % len(CONTROL_COLOURS)]
        bottom.axhline(band.mean, color=colour, linestyle="--", linewidth=1.2)
        if math.isfinite(band.low) and math.isfinite(band.high):
            bottom.axhspan(band.low, band.high, color=colour, alpha=0.12, linewidth=0)
        bottom.plot([], [], color=colour, linestyle="--", label=f"{name} ({band.mean:.3f})")
    bottom.set_ylabel("host val acc\n(end of episode)")
    bottom.set_xlabel(
        "PPO update" + ("  (dashed: esper evaluate of the run, val split)" if controls else "")
    )
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="x-small")
    if len(rollouts) == 1:
        bottom.set_xlim(numbers[0] - 1, numbers[0] + 1)
    bottom.xaxis.get_major_locator().set_params(integer=True)

    image = figure_to_array(fig, width, height)
    if path is not None:
        write_png(image, path)
    return image


def rolling_band(values: np.ndarray, window: int = ROLLING_UPDATES) -> tuple[np.ndarray, ...]:
    """``(mean, low, high)`` ``[U]``: the mean of the last ``window`` finite values up to
    each position, and its Student-t 95% interval (NaN where fewer than two are in it):
    :func:`clustered_mean` with each update its own unit."""
    bands = np.full((3, len(values)), math.nan)
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        part = part[np.isfinite(part)]
        if part.size:
            estimate = clustered_mean(part, np.arange(part.size))
            bands[:, i] = estimate.mean, estimate.low, estimate.high
    return bands[0], bands[1], bands[2]


def _draw_rolling(
    ax, xs: np.ndarray, values: np.ndarray, colour: str, label: str | None = None
) -> None:
    ax.plot(xs, values, color=colour, linewidth=0.8, alpha=0.35)
    mean, low, high = rolling_band(values)
    # A marker on each mean: a line needs two points, so a run of one update (or an
    # update between two non-finite ones) drew nothing at all.
    ax.plot(xs, mean, color=colour, linewidth=1.8, label=label, marker="o", markersize=2.5)
    ax.fill_between(xs, low, high, color=colour, alpha=0.2, linewidth=0)


def report(run_dir: Path | str) -> list[Path]:
    """Write ``learning_curve.png`` beside every ``events.jsonl`` under ``run_dir``.

    Searches ``run_dir`` and its subfolders (``lightning_logs/version_*``). An event log
    without a finished PPO update is skipped with a warning, unless no log has one, which
    raises that log's ValueError. Returns the pictures written, in path order.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    logs = sorted(run_dir.rglob(EVENTS_FILE))
    if not logs:
        raise FileNotFoundError(
            f"no {EVENTS_FILE} under {run_dir}; it is written by the telemetry "
            "callback (on by default in `esper fit`) into the run's log directory"
        )
    written: list[Path] = []
    errors: list[ValueError] = []
    for log in logs:
        out = log.parent / LEARNING_CURVE_FILE
        found = [
            p for p in (log.parent / EVALUATION_JSON, run_dir / EVALUATION_JSON) if p.is_file()
        ]
        controls = evaluated_controls(found[0]) if found else None
        try:
            render_learning_curve(log, out, controls=controls)
        except ValueError as exc:
            errors.append(exc)
            warnings.warn(f"esper report: skipped {log}: {exc}", stacklevel=2)
            continue
        written.append(out)
    if not written:
        raise errors[0]
    return written


# ------------------------------------------------------------------ reading
def evaluated_controls(path: Path) -> dict[str, Band]:
    """Each controller's mean final validation accuracy in an ``esper evaluate``'s
    ``evaluation.json``, with its 95% interval counting each episode group once; the
    learned policy's own row is left out (the curve is the learned policy). Empty, with a
    warning, where the file is not an evaluation."""
    try:
        payload = json.loads(path.read_text())
        per_episode = payload["final_val_acc"]
        groups = payload["episode_group"]
        rows = [r["controller"] for r in payload["rows"]]
    except (ValueError, KeyError, TypeError):
        warnings.warn(f"esper report: {path} is not an evaluation; drawn without it", stacklevel=3)
        return {}
    controls: dict[str, Band] = {}
    for name in rows:
        values = per_episode.get(name) if isinstance(per_episode, dict) else None
        if name == LEARNED or not values:
            continue
        estimate = clustered_mean(values, groups[: len(values)])
        controls[name] = Band(estimate.mean, estimate.low, estimate.high)
    return controls


def _read_log(
    path: Path,
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[int, dict[str, Any]]]]:
    """``ppo_update`` metrics by rollout, and ``episode_end`` records by rollout and env."""
    if not path.is_file():
        raise FileNotFoundError(f"event log {path} does not exist")
    updates: dict[int, dict[str, Any]] = {}
    episodes: dict[int, dict[int, dict[str, Any]]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # the last line of a run that crashed mid-write
                break
            raise ValueError(f"{path}:{number} is not a JSON object ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} is not a JSON object")
        kind = record.get("kind")
        rollout = record.get("rollout")
        if not isinstance(rollout, int):
            continue
        if kind == "resume":
            # The resumed run repeats rollouts from this one on: forget what was written.
            updates = {r: m for r, m in updates.items() if r < rollout}
            episodes = {r: e for r, e in episodes.items() if r < rollout}
        elif kind == "ppo_update":
            metrics = record.get("metrics")
            updates[rollout] = metrics if isinstance(metrics, dict) else {}
        elif kind == "episode_end" and isinstance(record.get("env"), int):
            episodes.setdefault(rollout, {})[record["env"]] = record
    return updates, episodes


def _metric(
    metrics: dict[str, Any],
    key: str,
    episodes: dict[int, dict[str, Any]] | None,
    episode_key: str,
) -> float:
    """``metrics[key]``; else the mean of the rollout's ``episode_end`` values; else NaN."""
    if key in metrics:
        return _float(metrics[key])
    if episodes:
        values = [_float(e.get(episode_key)) for e in episodes.values()]
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            return float(np.mean(finite))
    return math.nan


def _float(value: Any) -> float:
    """A JSON number as float; ``null`` (non-finite when written) and junk as NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _run_name(events_jsonl: Path) -> str:
    parent = events_jsonl.resolve().parent
    if parent.name.startswith("version_") and parent.parent.name:
        return f"{parent.parent.name}/{parent.name}"
    return parent.name or str(parent)


__all__ = [
    "ACCURACY_KEY",
    "EVENTS_FILE",
    "LEARNING_CURVE_FILE",
    "LEARNING_CURVE_SIZE",
    "RETURN_KEY",
    "render_learning_curve",
    "report",
]
