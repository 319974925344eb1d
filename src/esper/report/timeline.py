"""One env's episode as a picture: each slot's seed stage per host epoch, and the host's accuracy.

:func:`render_timeline` draws the :class:`~esper.contracts.rollout.StepBatch` list of one
rollout (what ``RolloutCollector.collect(on_step=...)`` or an
:class:`~esper.callbacks.base.EsperCallback` receives) for one env:

* top panel: one row per slot, one column per host epoch; a cell has the colour of the
  stage the slot's seed was in *while that epoch trained* (:data:`STAGE_COLOURS`, named in
  the legend). Markers sit on the boundary between epochs, where the policy acted:
  germinate (with the blueprint's name), fossilize, prune. A dashed red line marks a
  governor rollback, a dotted grey one an epoch the env sat out after running out of
  device memory; the epoch after a decision the env did not take (it had just been
  restored, ``StepBatch.active`` False) is hatched.
* bottom panel, same x axis: the host's validation accuracy after each epoch.

Column ``k`` reads the stages reported after epoch ``k`` (``StepBatch.stages`` of the
decision taken after epoch ``k - 1``) with that epoch's cool-down ticks undone, so a seed
pruned after epoch 2 shows PRUNED for epoch 3 even though the clock moved it to
EMBARGOED when epoch 3 ended. The first column of an episode (step 0) is all DORMANT:
every episode starts on a fresh host.

Figures are drawn on matplotlib's Agg canvas directly (``matplotlib.figure.Figure`` and
``FigureCanvasAgg``), so no global backend is selected and nothing needs a display.
Everything read is host-side numpy; nothing here touches a device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from esper.contracts.rollout import StepBatch
from esper.contracts.stages import SeedStage

#: Default ``(width, height)`` of a timeline in pixels.
TIMELINE_SIZE: tuple[int, int] = (1000, 600)

#: Smallest picture :func:`render_timeline` and the learning curve agree to draw. A
#: timeline also needs room for its legend beside or below its panels, leaving them
#: :data:`PANELS_MIN_SIZE`: 400x400 or 1000x330 pixels have it, 320x240 or 640x300 do
#: not, and say so.
MIN_SIZE: tuple[int, int] = (200, 150)

#: Dots per inch of every figure; sizes are given in pixels, so this only scales fonts.
DPI = 100

#: The fixed colour of each stage (matplotlib colour names).
STAGE_COLOURS: dict[SeedStage, str] = {
    SeedStage.DORMANT: "whitesmoke",
    SeedStage.GERMINATED: "palegreen",
    SeedStage.TRAINING: "mediumseagreen",
    SeedStage.BLENDING: "deepskyblue",
    SeedStage.HOLDING: "royalblue",
    SeedStage.FOSSILIZED: "gold",
    SeedStage.PRUNED: "tomato",
    SeedStage.EMBARGOED: "lightsalmon",
    SeedStage.RESETTING: "plum",
}

# Marker style per lifecycle event kind drawn on a slot's row: (marker, colour, size).
_MARKERS: dict[str, tuple[str, str, float]] = {
    "germinated": ("^", "darkgreen", 9.0),
    "fossilized": ("*", "darkgoldenrod", 14.0),
    "pruned": ("X", "crimson", 9.0),
}
#: How the legend names each marker: the moment a seed is planted, made permanent or cut
#: (an event), apart from the stage colours' names (a state it is in for an epoch).
_EVENT_LABELS = {
    "germinated": "planted here (blueprint beside it)",
    "fossilized": "fossilized here (merged)",
    "pruned": "pruned here",
}
#: The legend's font size (matplotlib's names).
LEGEND_FONT_SIZE = "small"
#: The room in pixels, ``(width, height)``, that the two panels need with their title,
#: labels and ticks (a host of up to four slots): the legend goes beside or below them
#: only where it leaves them that much.
PANELS_MIN_SIZE: tuple[int, int] = (360, 240)
#: The share of the picture's width or height a legend may span (constrained layout's
#: margins take the rest).
LEGEND_SPAN_SHARE = 0.96
#: Font size of the blueprint name beside a planting marker: readable at the default size.
BLUEPRINT_FONT_SIZE = 8.5
_ROLLBACK = {"color": "red", "linestyle": "--", "linewidth": 1.2}
_OOM_SKIP = {"color": "dimgray", "linestyle": ":", "linewidth": 1.2}


def render_timeline(
    steps: Sequence[StepBatch],
    env: int,
    slot_ids: Sequence[str],
    size: tuple[int, int] = TIMELINE_SIZE,
    path: Path | str | None = None,
    label: str | None = None,
) -> np.ndarray:
    """Draw env ``env``'s episode from the ``steps`` of one rollout.

    Args:
        steps: the step batches of one rollout, in order (one per decision).
        env: which env to draw (an index into the batches' env axis).
        slot_ids: the host's slot names, in the order of ``StepBatch.stages``' columns
            (``MorphogeneticVecEnv.slot_ids``).
        size: ``(width, height)`` of the picture in pixels.
        path: where to write it as PNG as well (parent folders are created).
        label: what the title calls the episode (e.g. ``"learned, episode 3"``); default
            ``"env E, rollout R"``.

    Returns:
        the picture, ``uint8`` RGB of shape ``(height, width, 3)``.
    """
    width, height = check_size(size, "render_timeline")
    steps = list(steps)
    if not steps:
        raise ValueError("render_timeline needs at least one StepBatch; got none")
    rollouts = sorted({s.rollout for s in steps})
    if len(rollouts) > 1:
        raise ValueError(
            f"render_timeline draws one episode, but the steps come from rollouts {rollouts}; "
            "pass the steps of one rollout"
        )
    n_envs = steps[0].n_envs
    if isinstance(env, bool) or not isinstance(env, int | np.integer) or not 0 <= env < n_envs:
        raise ValueError(f"render_timeline(env={env!r}): the steps hold envs 0..{n_envs - 1}")
    env = int(env)
    slot_ids = [str(s) for s in slot_ids]
    if not slot_ids:
        raise ValueError("render_timeline needs the host's slot_ids; got none")
    for s in steps:
        if s.stages.size and s.stages.shape != (n_envs, len(slot_ids)):
            raise ValueError(
                f"step {s.step} has stages of shape {s.stages.shape}, but {n_envs} envs and "
                f"{len(slot_ids)} slot_ids {slot_ids} make {(n_envs, len(slot_ids))}; "
                "pass the slot_ids of the env that produced the steps"
            )

    fig = new_figure(width, height)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    epochs, grid = _stage_grid(steps, env, slot_ids)
    _draw_stages(top, epochs, grid, slot_ids)
    _draw_skipped(top, steps, env, len(slot_ids))
    labelled = _draw_events(top, bottom, steps, env, slot_ids)
    final = _draw_accuracy(bottom, steps, env)

    top.set_ylabel("seed slot")
    name = label if label is not None else f"env {env}, rollout {rollouts[0]}"
    accuracy = f"{final:.3f}" if np.isfinite(final) else "n/a"
    # Over the whole picture, wrapped to its width: over the top panel alone a long label
    # ran under a legend beside the panels, or off a narrow picture.
    title = fig.suptitle(
        f"{name}: seed stages per host epoch (final val acc {accuracy})",
        fontsize="medium",
        wrap=True,
    )
    bottom.set_xlabel("host epoch")
    bottom.set_xlim(epochs[0] - 0.5, epochs[-1] + 0.5)
    step = max(1, int(np.ceil(len(epochs) / 25)))
    bottom.set_xticks(epochs[::step])
    image = _draw_with_legend(fig, title, _legend_handles(labelled), width, height)
    if path is not None:
        write_png(image, path)
    return image


# ------------------------------------------------------------------ shared helpers
def check_size(size: tuple[int, int], where: str) -> tuple[int, int]:
    """``size`` as two ints ``(width, height)``, or a ValueError naming ``where``."""
    try:
        width, height = size
    except (TypeError, ValueError):
        raise ValueError(f"{where}: size must be (width, height) in pixels, got {size!r}") from None
    for value in (width, height):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{where}: size must be two ints (width, height), got {size!r}")
    if width < MIN_SIZE[0] or height < MIN_SIZE[1]:
        raise ValueError(f"{where}: size {size!r} is below the smallest drawable {MIN_SIZE}")
    return int(width), int(height)


def new_figure(width: int, height: int) -> Figure:
    # A quarter pixel over: Agg truncates the float figure size, and w / dpi * dpi may
    # land just under w.
    fig = Figure(
        figsize=((width + 0.25) / DPI, (height + 0.25) / DPI), dpi=DPI, layout="constrained"
    )
    FigureCanvasAgg(fig)
    return fig


def figure_to_array(fig: Figure, width: int, height: int) -> np.ndarray:
    """Draw ``fig`` on its Agg canvas; the RGB pixels, checked to be ``(height, width, 3)``."""
    canvas = fig.canvas
    assert isinstance(canvas, FigureCanvasAgg), "figures here are made by new_figure"
    canvas.draw()
    image = np.array(canvas.buffer_rgba(), dtype=np.uint8)[..., :3]
    if image.shape != (height, width, 3):  # pragma: no cover - guards the size arithmetic
        raise RuntimeError(
            f"matplotlib drew {image.shape[1]}x{image.shape[0]} pixels, not {width}x{height}"
        )
    return np.ascontiguousarray(image)


def write_png(image: np.ndarray, path: Path | str) -> Path:
    """Write ``image`` (``uint8`` RGB) to ``path`` as PNG, pixel for pixel."""
    from matplotlib.image import imsave

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, image, format="png")
    return path


# ------------------------------------------------------------------ drawing
def _stage_grid(
    steps: Sequence[StepBatch], env: int, slot_ids: Sequence[str]
) -> tuple[np.ndarray, np.ma.MaskedArray]:
    """Host epochs drawn, and ``[S, epochs]`` the stage during each (masked where unknown)."""
    first = min(s.host_epoch for s in steps)
    last = max(s.host_epoch for s in steps) + 1
    epochs = np.arange(first, last + 1)
    grid = np.ma.masked_all((len(slot_ids), len(epochs)), dtype=np.int64)
    row = {slot: i for i, slot in enumerate(slot_ids)}
    for s in steps:
        if s.step == 0 and s.host_epoch == first:
            grid[:, 0] = int(SeedStage.DORMANT)  # an episode starts on a fresh host
        if not s.stages.size:
            continue
        column = s.host_epoch + 1 - first
        stages = s.stages[env].astype(np.int64).copy()
        # Undo the cool-down ticks at the end of that epoch: show the stage it trained in.
        for event in s.events:
            if (
                event.kind == "cooldown"
                and event.env == env
                and event.slot in row
                and (event.host_epoch or s.host_epoch + 1) == s.host_epoch + 1
                and event.stage_from in SeedStage.__members__
            ):
                stages[row[event.slot]] = int(SeedStage[event.stage_from])
        grid[:, column] = stages
    return epochs, grid


def _draw_stages(ax, epochs: np.ndarray, grid: np.ma.MaskedArray, slot_ids: Sequence[str]) -> None:
    colours = [STAGE_COLOURS[stage] for stage in SeedStage]
    x_edges = np.append(epochs - 0.5, epochs[-1] + 0.5)
    y_edges = np.arange(len(slot_ids) + 1) - 0.5
    ax.pcolormesh(
        x_edges,
        y_edges,
        grid,
        cmap=ListedColormap(colours),
        vmin=-0.5,
        vmax=len(colours) - 0.5,
        edgecolors="white",
        linewidth=0.5,
    )
    ax.set_ylim(len(slot_ids) - 0.5, -0.5)  # first slot on top
    # "slot 0 (host stage0)": a slot id names the place in the host, not a lifecycle stage.
    ax.set_yticks(range(len(slot_ids)), [f"slot {i}\n(host {s})" for i, s in enumerate(slot_ids)])
    ax.tick_params(axis="x", labelbottom=False)


def _draw_skipped(ax, steps: Sequence[StepBatch], env: int, n_slots: int) -> None:
    """Hatch the epoch after each decision the env did not take (just rolled back)."""
    for s in steps:
        if s.active.size and not bool(s.active[env]):
            ax.add_patch(
                Rectangle(
                    (s.host_epoch + 0.5, -0.5),
                    1.0,
                    n_slots,
                    fill=False,
                    hatch="///",
                    edgecolor="dimgray",
                    linewidth=0,
                )
            )


def _draw_events(
    top, bottom, steps: Sequence[StepBatch], env: int, slot_ids: Sequence[str]
) -> set[str]:
    """Markers and lines for this env's events; the kinds drawn (for the legend)."""
    row = {slot: i for i, slot in enumerate(slot_ids)}
    drawn: set[str] = set()
    for s in steps:
        if s.active.size and not bool(s.active[env]):
            drawn.add("skipped")
        for event in s.events:
            if event.env != env:
                continue
            x = (event.host_epoch or s.host_epoch) + 0.5  # between the epochs it sits between
            if event.kind in ("rollback", "oom_skip"):
                style = _ROLLBACK if event.kind == "rollback" else _OOM_SKIP
                for ax in (top, bottom):
                    ax.axvline(x, **style)
                drawn.add(event.kind)
                continue
            if event.kind not in _MARKERS:
                continue
            if event.slot not in row:
                raise ValueError(
                    f"a {event.kind} event names slot {event.slot!r}, which is not among "
                    f"slot_ids {list(slot_ids)}; pass the slot_ids of the env that produced "
                    "the steps"
                )
            marker, colour, size = _MARKERS[event.kind]
            y = row[event.slot]
            top.plot(
                x,
                y,
                marker=marker,
                color=colour,
                markersize=size,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
                zorder=3,
            )
            if event.kind == "germinated" and event.blueprint:
                top.annotate(
                    event.blueprint,
                    (x, y),
                    xytext=(6, -10),
                    textcoords="offset points",
                    fontsize=BLUEPRINT_FONT_SIZE,
                    color="black",
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8},
                    zorder=4,
                )
            drawn.add(event.kind)
    return drawn


def _draw_accuracy(ax, steps: Sequence[StepBatch], env: int) -> float:
    """The host's validation accuracy after each epoch; returns the last one."""
    acc: dict[int, float] = {}
    for s in sorted(steps, key=lambda b: b.step):
        acc[s.host_epoch] = float(s.val_acc[env])
        acc[s.host_epoch + 1] = float(s.next_val_acc[env])
    epochs = sorted(acc)
    values = [acc[e] for e in epochs]
    ax.plot(epochs, values, marker="o", markersize=3, color="black", linewidth=1.2)
    ax.set_ylabel("host val acc")
    ax.grid(True, alpha=0.3)
    finite = [v for v in values if np.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        pad = max(0.02, 0.1 * (high - low))
        ax.set_ylim(max(0.0, low - pad), min(1.0, high + pad) if high <= 1.0 else high + pad)
    return values[-1]


#: Every kind of mark a timeline may add to the legend: its placement is chosen for all
#: of them, so whether a size draws does not depend on what an episode did.
_EVERY_MARK = frozenset({"rollback", "oom_skip", "skipped"})


def _draw_with_legend(
    fig: Figure, title: Text, handles: list[object], width: int, height: int
) -> np.ndarray:
    """Draw ``fig`` with its legend beside the panels in one column, where the fullest
    legend leaves the panels :data:`PANELS_MIN_SIZE` and clears the title; else below them
    in as many columns as fit the width; a ValueError where neither fits.

    Why: matplotlib's constrained layout does not fit a legend to the picture. One beside
    the panels that is wider or taller than the picture leaves them no room (the layout
    gives up, with a warning, and draws the legend over them), is cut off at the top, or
    runs into a title wider than the panels. The room is judged on the fullest legend, so
    whether a size draws does not depend on what an episode did.
    """
    canvas = fig.canvas
    assert isinstance(canvas, FigureCanvasAgg), "figures here are made by new_figure"
    renderer = canvas.get_renderer()
    fullest = _legend_handles(set(_EVERY_MARK))

    def legend(where: list[object], loc: str, ncols: int = 1) -> Legend:
        return fig.legend(
            handles=where, loc=loc, ncols=ncols, fontsize=LEGEND_FONT_SIZE, frameon=False
        )

    def extent(loc: str, ncols: int) -> Bbox:
        """The fullest legend's box, so placed (before the layout moves it)."""
        probe = legend(fullest, loc, ncols)
        box = probe.get_window_extent(renderer)
        probe.remove()
        return box

    panels_width, panels_height = PANELS_MIN_SIZE
    beside = extent("outside right upper", 1)
    if (
        width - beside.width >= panels_width
        and height >= panels_height
        and beside.height <= LEGEND_SPAN_SHARE * height
    ):
        placed = legend(handles, "outside right upper")
        image = figure_to_array(fig, width, height)
        box = placed.get_window_extent(renderer)
        if box.y0 >= 0 and box.y1 <= height and not box.overlaps(title.get_window_extent(renderer)):
            return image
        placed.remove()
    if width >= panels_width:
        for ncols in range(len(fullest), 0, -1):
            below = extent("outside lower center", ncols)
            if below.width > LEGEND_SPAN_SHARE * width:
                continue  # fewer columns, then
            if height - below.height < panels_height:
                break  # fewer columns are taller still
            legend(handles, "outside lower center", ncols)
            return figure_to_array(fig, width, height)
    raise ValueError(
        f"render_timeline: a {width}x{height} picture has no room for the legend "
        f"({beside.width:.0f}x{beside.height:.0f} pixels in one column) beside or below the "
        f"panels; draw it larger, e.g. at the default size {TIMELINE_SIZE}"
    )


def _legend_handles(drawn: set[str]) -> list[object]:
    handles: list[object] = [
        Patch(facecolor=STAGE_COLOURS[stage], edgecolor="gray", label=stage.name.lower())
        for stage in SeedStage
    ]
    for kind, (marker, colour, size) in _MARKERS.items():
        handles.append(
            Line2D(
                [],
                [],
                marker=marker,
                color=colour,
                markersize=size * 0.8,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
                label=_EVENT_LABELS[kind],
            )
        )
    if "rollback" in drawn:
        handles.append(Line2D([], [], label="rollback", **_ROLLBACK))
    if "oom_skip" in drawn:
        handles.append(Line2D([], [], label="sat out (OOM)", **_OOM_SKIP))
    if "skipped" in drawn:
        handles.append(
            Patch(facecolor="none", edgecolor="dimgray", hatch="///", label="no decision")
        )
    return handles


__all__ = [
    "DPI",
    "MIN_SIZE",
    "STAGE_COLOURS",
    "TIMELINE_SIZE",
    "check_size",
    "figure_to_array",
    "new_figure",
    "render_timeline",
    "write_png",
]
