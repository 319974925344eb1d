"""Learning curves from a run's telemetry event log, and the ``esper report`` entry point.

:func:`render_learning_curve` reads the ``events.jsonl`` that
:class:`~esper.callbacks.telemetry.TelemetryCallback` writes and plots, per PPO update,
the mean episode return (top panel) and the host's validation accuracy at the end of the
episode (bottom panel; the mean over envs as a line, each env's value as a faint dot when
the log has ``episode_end`` lines).

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
from pathlib import Path
from typing import Any

import numpy as np

from esper.report.timeline import check_size, figure_to_array, new_figure, write_png

#: Default ``(width, height)`` of a learning curve in pixels.
LEARNING_CURVE_SIZE: tuple[int, int] = (1000, 500)

#: Name of the telemetry event log :func:`report` looks for.
EVENTS_FILE = "events.jsonl"

#: Name of the picture :func:`report` writes beside each event log.
LEARNING_CURVE_FILE = "learning_curve.png"

RETURN_KEY = "train/episode_return"
ACCURACY_KEY = "train/host_val_acc"


#: Where ``esper evaluate`` writes its figures by default, relative to the run folder.
EVALUATION_JSON = Path("evaluation") / "evaluation.json"


def render_learning_curve(
    events_jsonl: Path | str,
    path: Path | str | None = None,
    size: tuple[int, int] = LEARNING_CURVE_SIZE,
    no_growth_acc: float | None = None,
) -> np.ndarray:
    """Plot mean episode return and host accuracy over PPO updates from ``events_jsonl``.

    ``no_growth_acc`` (from an ``esper evaluate`` of the run) is drawn across the accuracy
    plot as the reference the grown hosts are read against.

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
    returns = [_metric(updates[r], RETURN_KEY, episodes.get(r), "episode_return") for r in rollouts]
    accuracy = [
        _metric(updates[r], ACCURACY_KEY, episodes.get(r), "final_val_acc") for r in rollouts
    ]

    fig = new_figure(width, height)
    top, bottom = fig.subplots(2, 1, sharex=True)
    style: dict[str, Any] = {"marker": "o", "markersize": 3} if len(rollouts) <= 60 else {}
    top.plot(rollouts, returns, color="tab:blue", linewidth=1.4, **style)
    top.set_ylabel("episode return\n(mean over envs)")
    top.grid(True, alpha=0.3)
    top.set_title(f"{_run_name(events_jsonl)}: {len(rollouts)} PPO update(s)", fontsize="medium")

    per_env = [
        (r, _float(e.get("final_val_acc"))) for r in rollouts for e in episodes.get(r, {}).values()
    ]
    if per_env:
        xs, ys = zip(*per_env, strict=True)
        bottom.scatter(xs, ys, s=6, color="tab:green", alpha=0.25, linewidths=0, label="per env")
    bottom.plot(
        rollouts, accuracy, color="tab:green", linewidth=1.4, label="mean over envs", **style
    )
    if no_growth_acc is not None:
        bottom.axhline(
            no_growth_acc,
            color="grey",
            linestyle="--",
            linewidth=1.2,
            label=f"no growth, esper evaluate ({no_growth_acc:.3f})",
        )
    bottom.set_ylabel("host val acc\n(end of episode)")
    bottom.set_xlabel("PPO update (rollout)")
    bottom.grid(True, alpha=0.3)
    if per_env or no_growth_acc is not None:
        bottom.legend(loc="lower right", fontsize="small")
    if len(rollouts) == 1:
        bottom.set_xlim(rollouts[0] - 1, rollouts[0] + 1)
    bottom.xaxis.get_major_locator().set_params(integer=True)

    image = figure_to_array(fig, width, height)
    if path is not None:
        write_png(image, path)
    return image


def report(run_dir: Path | str) -> list[Path]:
    """Write ``learning_curve.png`` beside every ``events.jsonl`` under ``run_dir``.

    Searches ``run_dir`` and its subfolders (``lightning_logs/version_*``). An event log
    without a finished PPO update is skipped with a warning, unless no log has one, which
    raises that log's ValueError. Returns the pictures written, in path order.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"esper report: run directory {run_dir} does not exist")
    logs = sorted(run_dir.rglob(EVENTS_FILE))
    if not logs:
        raise FileNotFoundError(
            f"esper report: no {EVENTS_FILE} under {run_dir}; it is written by the telemetry "
            "callback (on by default in `esper fit`) into the run's log directory"
        )
    written: list[Path] = []
    errors: list[ValueError] = []
    no_growth_acc = _no_growth_reference(run_dir)
    for log in logs:
        out = log.parent / LEARNING_CURVE_FILE
        try:
            render_learning_curve(log, out, no_growth_acc=no_growth_acc)
        except ValueError as exc:
            errors.append(exc)
            warnings.warn(f"esper report: skipped {log}: {exc}", stacklevel=2)
            continue
        written.append(out)
    if not written:
        raise errors[0]
    return written


# ------------------------------------------------------------------ reading
def _no_growth_reference(run_dir: Path) -> float | None:
    """No growth's mean final accuracy from ``<run_dir>/evaluation/evaluation.json``
    (where ``esper evaluate`` writes by default), or None when there is none."""
    path = run_dir / EVALUATION_JSON
    if not path.is_file():
        return None
    try:
        rows = json.loads(path.read_text())["rows"]
        return next(float(r["final_val_acc_mean"]) for r in rows if r["controller"] == "no_growth")
    except (ValueError, KeyError, TypeError, StopIteration):
        warnings.warn(f"esper report: {path} has no no-growth row; drawn without it", stacklevel=3)
        return None


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
