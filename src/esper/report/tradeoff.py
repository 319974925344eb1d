"""Test accuracy against training compute, one point per controller of an evaluation.

The question a researcher brings to ``esper evaluate`` is a trade: did growth buy its
accuracy more cheaply than a network chosen up front? The table answers it in numbers;
this picture answers it at a glance. Each controller is a point at its mean training
FLOPs and mean final test accuracy, with 95% intervals on both axes counting each episode
group once (the table's error bars), read from the ``evaluation.json`` that
:meth:`esper.evaluation.comparison.Evaluation.write` writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from esper.report.statistics import clustered_mean
from esper.report.timeline import check_size, figure_to_array, new_figure, write_png

#: Default ``(width, height)`` of the picture in pixels.
TRADEOFF_SIZE: tuple[int, int] = (900, 600)
#: Name of the picture ``esper evaluate`` writes beside its table.
TRADEOFF_FILE = "accuracy_vs_flops.png"
#: FLOPs per GFLOP, the unit of the x axis (as in the printed table).
GFLOP = 1e9
#: Offset of a controller's name from its marker, and the height of one more line, in
#: points; points closer than NEAR_FRACTION of each axis's span count as one place.
LABEL_OFFSET, LABEL_LINE, NEAR_FRACTION = 6.0, 13.0, 0.06
#: Room added right of the last point for its name, as a fraction of the x span.
LABEL_ROOM = 0.12
#: Marker colours, one per controller in the order the evaluation lists them.
COLOURS = ("#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f")


def render_accuracy_vs_flops(
    evaluation_json: Path | str,
    path: Path | str | None = None,
    size: tuple[int, int] = TRADEOFF_SIZE,
) -> np.ndarray:
    """Draw every controller of ``evaluation_json`` at (training GFLOP, test accuracy).

    Returns the picture as ``uint8`` RGB of shape ``(height, width, 3)`` and writes it as
    PNG to ``path`` when given. Raises ValueError naming the file when it is not an
    evaluation (no ``rows`` with test accuracy and FLOPs).
    """
    width, height = check_size(size, "render_accuracy_vs_flops")
    payload = _read(Path(evaluation_json))
    groups = payload.get("episode_group")
    fig = new_figure(width, height)
    ax = fig.add_subplot(1, 1, 1)
    points = [
        (row["train_flops_mean"] / GFLOP, row["final_test_acc_mean"]) for row in payload["rows"]
    ]
    offsets = _label_offsets(points)
    bars = False  # whether any interval was drawn: the title says which
    for i, row in enumerate(payload["rows"]):
        name = row["controller"]
        acc = row["final_test_acc_mean"]
        low, high = row.get("final_test_acc_low"), row.get("final_test_acc_high")
        flops = _flops_interval(payload, name, groups, row["train_flops_mean"])
        x = flops[0] / GFLOP
        y_err = _errors(acc, low, high)
        x_err = _errors(flops[0], flops[1], flops[2], scale=GFLOP)
        colour = COLOURS[i % len(COLOURS)]
        bars = bars or y_err is not None or x_err is not None
        ax.errorbar([x], [acc], xerr=x_err, yerr=y_err, fmt="o", color=colour, capsize=4)
        ax.annotate(name, (x, acc), xytext=offsets[i], textcoords="offset points", color=colour)
    seed = payload.get("seed")
    episodes = payload["rows"][0].get("episodes")
    ax.set_title(
        f"Final test accuracy against training compute\n{episodes} episode(s) per "
        f"controller, evaluation seed {seed} ({payload.get('seed_range', '?')} range); "
        + ("bars: 95% intervals" if bars else "no bars: one episode group gives no interval"),
        fontsize="medium",
    )
    ax.set_xlabel("training compute of the hosts, GFLOP per episode (mean)")
    ax.set_ylabel("final test accuracy (mean)")
    ax.grid(alpha=0.3)
    low_x, high_x = ax.get_xlim()
    ax.set_xlim(low_x, high_x + LABEL_ROOM * (high_x - low_x))  # the rightmost name fits
    image = figure_to_array(fig, width, height)
    if path is not None:
        write_png(image, path)
    return image


def _label_offsets(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where each controller's name goes, in points from its marker: beside it, and one
    line lower for every earlier controller drawn at nearly the same place (static_final
    and static_equal often coincide), so no two names overprint."""
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    span_x = float(np.ptp(xs)) or 1.0
    span_y = float(np.ptp(ys)) or 1.0
    offsets = []
    for i in range(len(points)):
        near = np.abs(xs[:i] - xs[i]) / span_x < NEAR_FRACTION
        near &= np.abs(ys[:i] - ys[i]) / span_y < NEAR_FRACTION
        offsets.append((LABEL_OFFSET, LABEL_OFFSET - LABEL_LINE * int(near.sum())))
    return offsets


def _read(path: Path) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not JSON ({exc}); pass an esper evaluate evaluation.json"
        ) from None
    rows = payload.get("rows") if isinstance(payload, dict) else None
    needed = ("controller", "final_test_acc_mean", "train_flops_mean")
    if not rows or not all(isinstance(r, dict) and all(k in r for k in needed) for r in rows):
        raise ValueError(
            f"{path}: no evaluation rows with {', '.join(needed)}; pass the evaluation.json "
            "esper evaluate wrote"
        )
    return payload


def _flops_interval(
    payload: dict[str, Any], name: str, groups: Any, mean: float
) -> tuple[float, float | None, float | None]:
    """Mean training FLOPs with its clustered 95% interval, where the file holds each
    episode's FLOPs and episode groups (else the mean alone)."""
    per_episode = (payload.get("train_flops") or {}).get(name)
    if not per_episode or not groups or len(groups) < len(per_episode):
        return mean, None, None
    estimate = clustered_mean(per_episode, groups[: len(per_episode)])
    return estimate.mean, estimate.low, estimate.high


def _errors(
    centre: float, low: float | None, high: float | None, scale: float = 1.0
) -> list[list[float]] | None:
    """Matplotlib's ``[[below], [above]]`` for an interval; None where there is none (a
    single episode group has no interval)."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return None
    return [[(centre - low) / scale], [(high - centre) / scale]]
