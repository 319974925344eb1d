"""Pictures: timelines from a real rollout, learning curves from event logs, the callback."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from matplotlib.image import imread
from matplotlib.text import Text
from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

from esper.callbacks.timeline import TimelineCallback
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch
from esper.contracts.stages import SeedStage
from esper.report import (
    LEARNING_CURVE_FILE,
    STAGE_COLOURS,
    TIMELINE_SIZE,
    render_learning_curve,
    render_timeline,
    report,
    timeline,
)
from esper.report.timeline import figure_to_array

#: Size of the pictures whose size is not what a test checks (smaller draws faster).
SMALL = (320, 240)
#: The same for timelines, whose legend needs more room (``render_timeline``).
SMALL_TIMELINE = (400, 400)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG as decoded."""
    image = imread(path)
    return image.shape[1], image.shape[0]


# ------------------------------------------------------------------ timeline
def test_timeline_from_a_real_rollout(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    path = tmp_path / "sub" / "timeline.png"
    image = render_timeline(steps, 1, slot_ids, path=path)
    assert image.shape == (600, 1000, 3)
    assert image.dtype == np.uint8
    assert TIMELINE_SIZE == (1000, 600)
    assert path.is_file() and path.stat().st_size > 1000
    assert png_size(path) == TIMELINE_SIZE
    # The PNG holds the returned pixels exactly.
    decoded = imread(path)
    assert np.array_equal((decoded[..., :3] * 255).round().astype(np.uint8), image)
    # Not a blank canvas: several colours drawn.
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 20


def test_a_timeline_label_replaces_env_and_rollout_in_the_title_only(rollout) -> None:
    steps, slot_ids = rollout
    default = render_timeline(steps, 1, slot_ids)
    same = render_timeline(steps, 1, slot_ids, label="env 1, rollout 0")
    named = render_timeline(steps, 1, slot_ids, label="learned, episode 3")
    assert np.array_equal(default, same)  # the default title is "env E, rollout R"
    changed = np.any(default != named, axis=(1, 2))
    title_rows = np.flatnonzero(changed)
    assert title_rows.size > 0 and title_rows.max() < default.shape[0] // 8  # title band only


def test_timeline_has_exactly_the_asked_size(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    size = (1001, 333)  # odd sizes: w / dpi * dpi may fall just short of w
    image = render_timeline(steps, 0, slot_ids, size=size, path=tmp_path / "t.png")
    assert image.shape == (size[1], size[0], 3)
    assert png_size(tmp_path / "t.png") == size


def test_every_stage_has_a_colour() -> None:
    assert set(STAGE_COLOURS) == set(SeedStage)
    assert len(set(STAGE_COLOURS.values())) == len(SeedStage)


def test_timeline_draws_rollbacks_and_skipped_decisions(rollout, tmp_path: Path) -> None:
    """Governor events (absent from the tiny rollout) and an inactive env draw without error."""
    steps, slot_ids = rollout
    e = 0
    last = steps[-1]
    edited = [
        *steps[:-1],
        replace(
            last,
            active=np.array([False, True]),
            events=(
                *last.events,
                LifecycleEvent("rollback", env=e, reason="loss not finite", host_epoch=0),
                LifecycleEvent("oom_skip", env=e, host_epoch=last.host_epoch + 1),
                LifecycleEvent(
                    "fossilized",
                    env=e,
                    slot=slot_ids[0],
                    stage_from="HOLDING",
                    stage_to="FOSSILIZED",
                    blueprint="conv_light",
                    host_epoch=last.host_epoch,
                ),
            ),
            next_val_acc=np.array([np.nan, 0.5]),
        ),
    ]
    plain = render_timeline(steps, e, slot_ids, size=SMALL_TIMELINE)
    marked = render_timeline(edited, e, slot_ids, size=SMALL_TIMELINE, path=tmp_path / "rb.png")
    assert marked.shape == plain.shape
    assert not np.array_equal(marked, plain)
    # Steps built without stages or active flags (the dataclass defaults) still draw.
    bare = [replace(s, stages=np.zeros((0, 0), np.int64), active=np.zeros(0, bool)) for s in steps]
    width, height = SMALL_TIMELINE
    assert render_timeline(bare, e, slot_ids, size=SMALL_TIMELINE).shape == (height, width, 3)


def _with_every_mark(steps: list[StepBatch], env: int) -> list[StepBatch]:
    """``steps`` with a rollback, an epoch sat out and a skipped decision for ``env`` added
    to the last one: every entry a timeline's legend can have."""
    last = steps[-1]
    active = np.ones(last.n_envs, bool)
    active[env] = False
    marks = (
        LifecycleEvent("rollback", env=env, reason="loss not finite", host_epoch=0),
        LifecycleEvent("oom_skip", env=env, host_epoch=last.host_epoch + 1),
    )
    return [*steps[:-1], replace(last, active=active, events=(*last.events, *marks))]


class _Figures:
    """Keeps each figure ``figure_to_array`` draws, to look at its legend's place."""

    def __init__(self) -> None:
        self.drawn: list = []

    def __call__(self, fig, width: int, height: int) -> np.ndarray:
        self.drawn.append(fig)
        return figure_to_array(fig, width, height)


@pytest.mark.parametrize("size", [TIMELINE_SIZE, (1001, 333), (600, 340), (400, 400)], ids=str)
def test_a_timeline_legend_keeps_clear_of_the_panels_and_title_inside_the_picture(
    rollout, monkeypatch: pytest.MonkeyPatch, size: tuple[int, int]
) -> None:
    """Beside the panels where the picture is wide enough, below them where it is not;
    before, a narrow picture drew its legend over the panels (constrained layout gave up
    with a warning), and one of 640x300 cut the legend's top and ran the title into it."""
    steps, slot_ids = rollout
    figures = _Figures()
    monkeypatch.setattr(timeline, "figure_to_array", figures)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # constrained layout warns when it gives up
        image = render_timeline(_with_every_mark(steps, 0), 0, slot_ids, size=size)
    assert image.shape == (size[1], size[0], 3)
    fig = figures.drawn[-1]
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.x0 >= 0 and box.x1 <= size[0] and box.y0 >= 0 and box.y1 <= size[1]
    assert len(legend.get_texts()) == len(STAGE_COLOURS) + 6  # 3 events, 3 marks
    title = fig.get_suptitle()
    (title_text,) = fig.findobj(lambda a: isinstance(a, Text) and a.get_text() == title)
    for other in (*fig.axes, title_text):
        assert not box.overlaps(other.get_window_extent(renderer)), other
    # Beside the panels (legend right of them) only where they keep their room.
    beside = box.x0 >= max(ax.get_window_extent(renderer).x1 for ax in fig.axes)
    assert beside == (size[0] >= 1000)


@pytest.mark.parametrize("size", [(320, 240), (640, 300), (600, 240)], ids=str)
def test_a_timeline_too_small_for_its_legend_says_so(rollout, size: tuple[int, int]) -> None:
    """Whatever the episode did: the room is judged on the fullest legend."""
    steps, slot_ids = rollout
    with pytest.raises(
        ValueError, match=rf"{size[0]}x{size[1]} picture has no room.*\(1000, 600\)"
    ):
        render_timeline(steps, 0, slot_ids, size=size)


def test_timeline_rejects_bad_arguments(rollout) -> None:
    steps, slot_ids = rollout
    with pytest.raises(ValueError, match="at least one StepBatch"):
        render_timeline([], 0, slot_ids)
    with pytest.raises(ValueError, match=r"env=2.*envs 0\.\.1"):
        render_timeline(steps, 2, slot_ids)
    with pytest.raises(ValueError, match="env=-1"):
        render_timeline(steps, -1, slot_ids)
    with pytest.raises(ValueError, match="slot_ids"):
        render_timeline(steps, 0, [*slot_ids, "extra"])
    with pytest.raises(ValueError, match="slot_ids"):
        render_timeline(steps, 0, [])
    with pytest.raises(ValueError, match="size"):
        render_timeline(steps, 0, slot_ids, size=(50, 50))
    with pytest.raises(ValueError, match="size"):
        render_timeline(steps, 0, slot_ids, size=(1000.0, 600))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one rollout"):
        render_timeline([*steps, replace(steps[0], rollout=1)], 0, slot_ids)
    renamed = [replace(s, stages=np.zeros((0, 0), np.int64)) for s in steps]
    if any(ev.slot for s in steps for ev in s.events if ev.env == 0):
        with pytest.raises(ValueError, match="not among slot_ids"):
            render_timeline(renamed, 0, ["a", "b"])


# ------------------------------------------------------------------ learning curve
def write_log(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def update(rollout: int, ret: float | None, acc: float | None) -> dict:
    return {
        "kind": "ppo_update",
        "rollout": rollout,
        "host_epoch": 25,
        "time": 0.0,
        "metrics": {"train/episode_return": ret, "train/host_val_acc": acc, "ppo/entropy": 1.0},
    }


def episode_end(rollout: int, env: int, acc: float) -> dict:
    return {
        "kind": "episode_end",
        "rollout": rollout,
        "env": env,
        "final_val_acc": acc,
        "episode_return": 0.1,
        "host_epoch": 25,
        "time": 0.0,
    }


def test_learning_curve_from_an_event_log(tmp_path: Path) -> None:
    records = [
        {"kind": "germinated", "rollout": 0, "host_epoch": 1, "env": 0, "slot": "s0"},
        *(episode_end(r, e, 0.5 + 0.05 * r + 0.01 * e) for r in range(4) for e in range(2)),
        *(update(r, 0.1 * r, 0.5 + 0.05 * r) for r in range(4)),
        update(4, None, None),  # non-finite values are written as null
    ]
    log = write_log(tmp_path / "events.jsonl", records)
    out = tmp_path / "curve.png"
    image = render_learning_curve(log, out)
    assert image.shape == (500, 1000, 3)
    assert png_size(out) == (1000, 500)
    assert render_learning_curve(log, size=SMALL).shape == (SMALL[1], SMALL[0], 3)


def test_a_learning_curve_of_one_update_shows_its_point(tmp_path: Path) -> None:
    """A line needs two points: with one update both panels drew no mark of it."""
    log = write_log(tmp_path / "events.jsonl", [episode_end(0, 0, 0.7), update(0, 1.5, 0.7)])
    image = render_learning_curve(log).astype(int)
    blue = np.array([31, 119, 180])  # matplotlib's tab:blue, the return panel's colour
    assert (np.abs(image - blue).sum(axis=2) < 30).sum() > 10


def test_learning_curve_resume_replaces_repeated_rollouts(tmp_path: Path) -> None:
    first = [update(r, 1.0, 0.5) for r in range(3)]
    resumed = [{"kind": "resume", "rollout": 1, "host_epoch": 0, "events_written": 3}]
    again = [update(r, -5.0, 0.9) for r in range(1, 4)]
    # Same folder names: the title names the run folder.
    log = write_log(tmp_path / "a" / "run" / "events.jsonl", first + resumed + again)
    # The same picture as a log that never had the dropped lines.
    clean = write_log(tmp_path / "b" / "run" / "events.jsonl", first[:1] + again)

    def draw(path: Path) -> np.ndarray:
        return render_learning_curve(path, size=SMALL)

    assert np.array_equal(draw(log), draw(clean))
    # Without a resume line, a repeated rollout's later line still wins.
    repeated = write_log(tmp_path / "c" / "run" / "events.jsonl", first + again)
    assert np.array_equal(draw(repeated), draw(clean))


def test_learning_curve_errors_name_the_file(tmp_path: Path) -> None:
    empty = write_log(tmp_path / "events.jsonl", [episode_end(0, 0, 0.5)])
    with pytest.raises(ValueError, match=r"events\.jsonl.*no 'ppo_update'"):
        render_learning_curve(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(update(0, 1.0, 0.5)) + "\n{oops\n" + json.dumps(update(1, 1, 1)))
    with pytest.raises(ValueError, match=r"broken\.jsonl:2"):
        render_learning_curve(broken)
    # A last line cut short by a crash is tolerated.
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps(update(0, 1.0, 0.5)) + '\n{"kind": "ppo_up')
    assert render_learning_curve(cut, size=SMALL).shape == (SMALL[1], SMALL[0], 3)
    with pytest.raises(FileNotFoundError, match="missing"):
        render_learning_curve(tmp_path / "missing.jsonl")


def test_report_writes_a_curve_beside_each_log(tmp_path: Path) -> None:
    run = tmp_path / "run"
    logs = run / "lightning_logs"
    write_log(logs / "version_0" / "events.jsonl", [update(0, 1.0, 0.5)])
    write_log(logs / "version_1" / "events.jsonl", [update(0, 2.0, 0.6)])
    # A log without a PPO update is skipped with a warning while the others draw.
    write_log(logs / "version_2" / "events.jsonl", [episode_end(0, 0, 0.5)])
    with pytest.warns(UserWarning, match="version_2"):
        written = report(str(run))
    assert written == [logs / f"version_{v}" / LEARNING_CURVE_FILE for v in (0, 1)]
    assert all(png_size(p) == (1000, 500) for p in written)
    assert not (logs / "version_2" / LEARNING_CURVE_FILE).exists()


def _evaluation(path: Path) -> Path:
    """An evaluation.json as esper evaluate writes it: rows, per-episode val accuracy and
    episode groups (two episodes a group)."""
    groups = [0, 0, 1, 1, 2, 2]
    values = {
        "learned": [0.9, 0.91, 0.92, 0.9, 0.93, 0.91],
        "no_growth": [0.7, 0.72, 0.69, 0.71, 0.7, 0.73],
        "static_final": [0.95, 0.96, 0.94, 0.95, 0.96, 0.95],
    }
    payload = {
        "rows": [{"controller": name} for name in values],
        "final_val_acc": values,
        "episode_group": groups,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return path


def test_evaluated_controls_are_every_control_with_its_clustered_interval(tmp_path: Path) -> None:
    from esper.report.curves import evaluated_controls
    from esper.report.statistics import clustered_mean

    path = _evaluation(tmp_path / "evaluation.json")
    controls = evaluated_controls(path)
    assert list(controls) == ["no_growth", "static_final"]  # the curve is the learned one
    payload = json.loads(path.read_text())
    for name, band in controls.items():
        expected = clustered_mean(payload["final_val_acc"][name], payload["episode_group"])
        assert band == (expected.mean, expected.low, expected.high)
    junk = tmp_path / "junk.json"
    junk.write_text("[]")
    with pytest.warns(UserWarning, match="not an evaluation"):
        assert evaluated_controls(junk) == {}


def test_report_draws_the_controls_of_the_evaluation_in_the_run_folder(tmp_path: Path) -> None:
    from esper.report.curves import evaluated_controls

    run = tmp_path / "project" / "lightning_logs" / "version_0"
    log = write_log(run / "events.jsonl", [update(r, 1.0, 0.5 + 0.01 * r) for r in range(6)])
    plain = render_learning_curve(log, size=SMALL)
    evaluation = _evaluation(run / "evaluation" / "evaluation.json")
    # From the project folder, as the README runs it: the evaluation beside the log is found.
    (written,) = report(tmp_path / "project")
    controls = evaluated_controls(evaluation)
    assert not np.array_equal(render_learning_curve(log, size=SMALL, controls=controls), plain)
    full = render_learning_curve(log, controls=controls)
    assert np.array_equal((imread(written)[..., :3] * 255).round().astype(np.uint8), full)


def test_learning_curve_numbers_updates_as_the_cli_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import esper.report.curves as curves

    figures = []
    made = curves.new_figure

    def keep(width: int, height: int):  # the figure the curve is drawn on
        figures.append(made(width, height))
        return figures[-1]

    monkeypatch.setattr(curves, "new_figure", keep)
    log = write_log(tmp_path / "events.jsonl", [update(r, 1.0, 0.5) for r in range(3)])
    render_learning_curve(log, size=SMALL)
    bottom = figures[0].axes[1]
    xs = {tuple(line.get_xdata()) for line in bottom.get_lines() if len(line.get_xdata())}
    assert xs == {(1, 2, 3)}  # "update 1/3" .. "update 3/3", never rollout 0


def test_rolling_band_is_the_mean_and_t_interval_of_the_last_updates() -> None:
    from esper.report.curves import ROLLING_UPDATES, rolling_band
    from esper.report.statistics import t_critical

    values = np.array([0.5, 0.7, np.nan, 0.6, 0.9, 0.8, 0.4, 0.65])
    mean, low, high = rolling_band(values)
    for i in range(len(values)):
        part = values[max(0, i - ROLLING_UPDATES + 1) : i + 1]
        part = part[np.isfinite(part)]
        assert mean[i] == pytest.approx(part.mean())
        if part.size < 2:
            assert np.isnan(low[i]) and np.isnan(high[i])
            continue
        half = t_critical(part.size) * part.std(ddof=1) / np.sqrt(part.size)
        assert (low[i], high[i]) == pytest.approx((part.mean() - half, part.mean() + half))


def test_report_errors_name_the_run_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        report(tmp_path / "nowhere")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no events\.jsonl under .*empty_run"):
        report(tmp_path / "empty_run")
    write_log(tmp_path / "idle" / "events.jsonl", [episode_end(0, 0, 0.5)])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no 'ppo_update'"):
        report(tmp_path / "idle")


# ------------------------------------------------------------------ callback
def summary_for(steps: list[StepBatch], rollout: int) -> RolloutSummary:
    n = steps[0].n_envs
    zeros = np.zeros(n, dtype=np.int64)
    return RolloutSummary(
        rollout=rollout,
        episode_return=np.zeros(n),
        final_val_acc=steps[-1].next_val_acc,
        seeds_germinated=zeros,
        seeds_fossilized=zeros,
        seeds_pruned=zeros,
        params_added=zeros,
        env_steps=n * len(steps),
        seconds=1.0,
        seconds_training_hosts=1.0,
        packed_transfers=len(steps) + 1,
    )


def drive(callback: TimelineCallback, trainer: Trainer, steps: list[StepBatch], rollouts: int):
    module = SimpleNamespace(env=SimpleNamespace(slot_ids=("stage0", "stage1")))
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    for r in range(rollouts):
        batch = [replace(s, rollout=r) for s in steps]
        callback.on_rollout_start(trainer, module, r)  # type: ignore[arg-type]
        for s in batch:
            callback.on_env_step(trainer, module, s)  # type: ignore[arg-type]
        callback.on_rollout_end(trainer, module, summary_for(batch, r))  # type: ignore[arg-type]
    callback.teardown(trainer, module, "fit")  # type: ignore[arg-type]


def bare_trainer(tmp_path: Path, callback: TimelineCallback, **kwargs: object) -> Trainer:
    """A Trainer for driving a callback's hooks by hand: no bar, summary or checkpoints."""
    return Trainer(
        default_root_dir=tmp_path,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,  # type: ignore[arg-type]
    )


def test_timeline_callback_logs_to_tensorboard_and_saves_png(rollout, tmp_path: Path) -> None:
    steps, slot_ids = rollout
    assert slot_ids == ("stage0", "stage1")
    logger = TensorBoardLogger(tmp_path)
    callback = TimelineCallback(every_n_updates=2, env=1)
    trainer = bare_trainer(tmp_path, callback, logger=logger)
    drive(callback, trainer, steps, rollouts=3)
    log_dir = Path(trainer.log_dir)
    assert callback.written == [log_dir / f"timeline_rollout{r:04d}.png" for r in (0, 2)]
    assert not (log_dir / "timeline_rollout0001.png").exists()
    assert all(png_size(p) == TIMELINE_SIZE for p in callback.written)
    logger.experiment.flush()
    events = EventAccumulator(str(log_dir), size_guidance={IMAGES: 0})
    events.Reload()
    assert "timeline/env1" in events.Tags()["images"]
    images = events.Images("timeline/env1")
    assert [i.step for i in images] == [0, 2]
    assert (images[0].width, images[0].height) == TIMELINE_SIZE


def test_timeline_callback_draws_the_first_and_the_last_rollout_of_a_short_run(
    rollout, tmp_path: Path
) -> None:
    steps, _ = rollout
    callback = TimelineCallback(every_n_updates=10, env=1)
    trainer = bare_trainer(tmp_path, callback, max_epochs=4, logger=TensorBoardLogger(tmp_path))
    drive(callback, trainer, steps, rollouts=4)
    log_dir = Path(trainer.log_dir)
    assert callback.written == [log_dir / f"timeline_rollout{r:04d}.png" for r in (0, 3)]


def test_timeline_callback_without_tensorboard_still_saves(rollout, tmp_path: Path) -> None:
    steps, _ = rollout
    callback = TimelineCallback(every_n_updates=1)
    trainer = bare_trainer(tmp_path, callback, logger=CSVLogger(tmp_path))
    drive(callback, trainer, steps, rollouts=1)
    assert [p.name for p in callback.written] == ["timeline_rollout0000.png"]
    assert callback.written[0].is_file()


def test_timeline_callback_arguments_and_state(rollout, tmp_path: Path) -> None:
    for bad in (0, -3):
        with pytest.raises(ValueError, match="every_n_updates"):
            TimelineCallback(every_n_updates=bad)
    for bad_type in (2.0, True, "3"):
        with pytest.raises(TypeError, match="every_n_updates"):
            TimelineCallback(every_n_updates=bad_type)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="env"):
        TimelineCallback(env=-1)
    with pytest.raises(TypeError, match="env"):
        TimelineCallback(env=1.5)  # type: ignore[arg-type]

    callback = TimelineCallback(every_n_updates=5, env=1)
    state = callback.state_dict()
    assert state == {"version": 1, "every_n_updates": 5, "env": 1}
    other = TimelineCallback(every_n_updates=3)
    other.load_state_dict(state)
    assert (other.every_n_updates, other.env) == (3, 0)  # the given config wins
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"version": 99})
    assert callback.state_key != other.state_key

    # Hooks before setup say what is wrong; an env index past this rank's envs too.
    steps, _ = rollout
    with pytest.raises(RuntimeError, match="not set up"):
        callback.on_env_step(None, None, steps[0])  # type: ignore[arg-type]
    far = TimelineCallback(every_n_updates=1, env=7)
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"env=7.*2 envs"):
        drive(far, trainer, steps, rollouts=1)


def test_timeline_legend_names_each_thing_once_and_rows_as_slots() -> None:
    from esper.report.timeline import _draw_stages, _legend_handles, new_figure

    labels = [h.get_label() for h in _legend_handles({"rollback", "skipped"})]
    assert len(labels) == len(set(labels)), labels  # a stage and an event never share a name
    fig = new_figure(400, 300)
    ax = fig.add_subplot(1, 1, 1)
    grid = np.ma.masked_all((2, 3), dtype=np.int64)
    _draw_stages(ax, np.arange(1, 4), grid, ["stage0", "stage1"])
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks == ["slot 0\n(host stage0)", "slot 1\n(host stage1)"]


def one_drawn_rollout(
    tmp_path: Path, steps: list[StepBatch], slot_ids: tuple[str, ...]
) -> tuple[TimelineCallback, Trainer, SimpleNamespace]:
    """A TimelineCallback that has handed rollout 0 to its helper, not yet collected."""
    callback = TimelineCallback(every_n_updates=1)
    trainer = bare_trainer(tmp_path, callback, logger=CSVLogger(tmp_path))
    module = SimpleNamespace(env=SimpleNamespace(slot_ids=slot_ids))
    callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    callback.on_rollout_start(trainer, module, 0)  # type: ignore[arg-type]
    for s in steps:
        callback.on_env_step(trainer, module, s)  # type: ignore[arg-type]
    callback.on_rollout_end(trainer, module, summary_for(steps, 0))  # type: ignore[arg-type]
    return callback, trainer, module


def test_timeline_callback_warns_of_a_picture_it_could_not_draw_and_goes_on(
    rollout, tmp_path: Path
) -> None:
    steps, _ = rollout
    callback, trainer, module = one_drawn_rollout(tmp_path, steps, ("only_one_slot",))
    with pytest.warns(UserWarning, match=r"TimelineCallback: drawing .*rollout0000\.png failed"):
        callback.teardown(trainer, module, "fit")  # type: ignore[arg-type]
    assert callback.written == []


def test_timeline_callback_finishes_its_pictures_when_the_run_is_interrupted(
    rollout, tmp_path: Path
) -> None:
    # Lightning's Ctrl-C path calls on_exception, not teardown: pictures asked for are
    # still written and the helper process stopped.
    steps, _ = rollout
    callback, trainer, module = one_drawn_rollout(tmp_path, steps, ("stage0", "stage1"))
    helper = callback._drawer._process  # type: ignore[union-attr]
    callback.on_exception(trainer, module, KeyboardInterrupt())  # type: ignore[arg-type]
    assert [p.name for p in callback.written] == ["timeline_rollout0000.png"]
    assert callback.written[0].is_file()
    assert helper is not None and helper.poll() is not None  # the helper has exited
