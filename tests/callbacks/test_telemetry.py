"""TelemetryCallback and its halves: JSONL events per profile, metrics through every logger,
TensorBoard histograms, state, host reads."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    EventAccumulator,
)

from esper.callbacks import (
    CALLBACKS,
    EsperCallback,
    EventLogCallback,
    MetricsCallback,
    TelemetryCallback,
)
from esper.callbacks.metrics import HOST_READS_TAG
from esper.callbacks.profiles import PROFILE_DEBUG, PROFILES
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch
from esper.contracts.stages import SeedStage
from esper.host_reads import WRAPPED_METHODS
from tests.callbacks.counting import count_rollout_reads

N_ENVS, N_SLOTS, STEPS = 2, 2, 3

#: The small real fit the host-read tests run: rollouts, envs, host, data.
REAL_ROLLOUTS, REAL_ENVS, REAL_EPISODE_EPOCHS = 2, 2, 3
REAL_HOST: dict[str, object] = {"channels": [4, 8]}
REAL_DATA: dict[str, int] = {"n_train": 64, "n_val": 32, "batch_size": 16}
#: The module's count of packed transfers per host epoch (esper.simic.update_metrics.rollout_metrics).
PACKED_TRANSFERS_TAG = "perf/packed_transfers_per_step"


def make_step(rollout: int, step: int, events: tuple[LifecycleEvent, ...] = ()) -> StepBatch:
    e = N_ENVS
    stages = np.full((e, N_SLOTS), int(SeedStage.DORMANT), dtype=np.int64)
    stages[0, 0] = int(SeedStage.TRAINING)
    return StepBatch(
        rollout=rollout,
        step=step,
        host_epoch=step + 1,
        actions=np.array([[1, 0, 2, 1], [0, 1, 0, 0]], dtype=np.int64),
        log_probs=np.full(e, -1.5),
        values=np.zeros(e),
        applied=np.array([True, False]),
        refused=np.array([False, step == 1]),
        illegal=np.zeros(e, dtype=bool),
        rewards=np.array([0.5, -0.25]),
        reward_components={"acc_delta": np.array([0.4, -0.2]), "rent": np.float32([0.1, -0.05])},
        train_loss=np.ones(e),
        val_loss=np.ones(e),
        val_acc=np.array([0.5, 0.6]),
        next_val_acc=np.array([0.55, 0.6]),
        loss_finite=np.ones(e, dtype=bool),
        contribution=np.zeros((e, N_SLOTS)),
        seed_params=np.array([100, 0], dtype=np.int64),
        legal_ops=np.array([3, 2], dtype=np.int64),
        done=np.full(e, step == STEPS - 1),
        stages=stages,
        events=events,
        mask_rates={"op": 0.75, "slot": 0.5, "blueprint": 1.0, "blend": 1.0},
    )


def make_summary(rollout: int) -> RolloutSummary:
    return RolloutSummary(
        rollout=rollout,
        episode_return=np.array([1.5, np.float64("nan")]),
        final_val_acc=np.float32([0.7, 0.65]),
        seeds_germinated=np.array([1, 0], dtype=np.int64),
        seeds_fossilized=np.array([0, 0], dtype=np.int64),
        seeds_pruned=np.array([0, 1], dtype=np.int64),
        params_added=np.array([100, 0], dtype=np.int64),
        env_steps=N_ENVS * STEPS,
        seconds=1.0,
        seconds_training_hosts=0.8,
        packed_transfers=STEPS + 1,
        rollbacks=np.array([0, 1], dtype=np.int64),
        discarded_transitions=np.array([0, 2], dtype=np.int64),
    )


EVENTS_BY_STEP: dict[int, tuple[LifecycleEvent, ...]] = {
    0: (
        LifecycleEvent("germinated", env=0, slot="s0", stage_to="GERMINATED", blueprint="conv"),
        LifecycleEvent("snapshot", env=1),
    ),
    1: (
        LifecycleEvent(
            "refused", env=1, slot="s1", stage_from="HOLDING", reason="contribution below 0.01"
        ),
        LifecycleEvent("advanced", env=0, slot="s0", stage_from="GERMINATED", stage_to="TRAINING"),
        LifecycleEvent("pruned", env=1, slot="s1", stage_to="PRUNED", blueprint="lora"),
    ),
    2: (
        LifecycleEvent("cooldown", env=1, slot="s1", stage_from="PRUNED", stage_to="EMBARGOED"),
        LifecycleEvent("rollback", env=1, reason="loss not finite"),
    ),
}


def make_trainer(tmp_path: Path, callback: EsperCallback, logger: object = None) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path,
        logger=logger if logger is not None else TensorBoardLogger(tmp_path),
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def drive(
    trainer: Trainer, callback: EsperCallback, rollouts: int = 1, start: int = 0
) -> LightningModule:
    """One fit's worth of hooks: setup, per rollout start/steps/end/update, teardown."""
    module = LightningModule()
    callback.setup(trainer, module, "fit")
    callback.on_fit_start(trainer, module)
    for r in range(start, start + rollouts):
        callback.on_rollout_start(trainer, module, r)
        for t in range(STEPS):
            callback.on_env_step(trainer, module, make_step(r, t, EVENTS_BY_STEP[t]))
        callback.on_rollout_end(trainer, module, make_summary(r))
        callback.on_ppo_update_end(trainer, module, {"ppo/loss": np.float32(0.5), "ppo/kl": 0.01})
    callback.on_fit_end(trainer, module)
    callback.teardown(trainer, module, "fit")
    for logger in trainer.loggers:
        logger.save()  # TensorBoard flushes its writer, CSV writes metrics.csv
    return module


def read_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tb(trainer: Trainer) -> EventAccumulator:
    """Every event of the trainer's log folder, whatever order its files load in: their
    names end in a per-process writer counter, which sorts 10 before 9, so a resumed run's
    file can load first, and purging "orphaned" steps would then drop its later steps."""
    acc = EventAccumulator(
        trainer.log_dir,
        size_guidance={SCALARS: 0, HISTOGRAMS: 0},
        purge_orphaned_data=False,
    )
    acc.Reload()
    return acc


def test_normal_profile_writes_every_event_kind(tmp_path: Path) -> None:
    callback = TelemetryCallback()
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback)
    assert callback.events.events_path == Path(trainer.log_dir) / "events.jsonl"
    events = read_events(callback.events.events_path)
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "germinated",
        "snapshot",
        "refused",
        "advanced",
        "pruned",
        "cooldown",
        "rollback",
        "episode_end",
        "episode_end",
        "ppo_update",
    ]
    for event in events:
        assert event["rollout"] == 0 and isinstance(event["host_epoch"], int)
        assert isinstance(event["time"], float)
    refused = events[2]
    assert refused["reason"] == "contribution below 0.01"
    assert (refused["env"], refused["slot"], refused["step"]) == (1, "s1", 1)
    assert events[0]["blueprint"] == "conv"
    assert events[6]["reason"] == "loss not finite"
    first_end, second_end = events[7], events[8]
    assert first_end["env"] == 0 and first_end["episode_return"] == 1.5
    assert first_end["final_val_acc"] == pytest.approx(0.7)
    assert first_end["params_added"] == 100 and first_end["host_epoch"] == STEPS + 1
    assert second_end["episode_return"] is None  # NaN is written as null
    assert second_end["rollbacks"] == 1 and second_end["discarded_transitions"] == 2
    assert events[9]["metrics"] == {"ppo/loss": 0.5, "ppo/kl": 0.01}
    assert callback.events.events_written == len(events)


def test_minimal_profile_keeps_only_key_events_and_no_tensorboard(tmp_path: Path) -> None:
    callback = TelemetryCallback(profile="minimal")
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback, rollouts=2)
    kinds = [e["kind"] for e in read_events(callback.events.events_path)]  # type: ignore[arg-type]
    assert set(kinds) == {"germinated", "pruned", "rollback", "episode_end", "ppo_update"}
    assert kinds.count("ppo_update") == 2 and kinds.count("episode_end") == 2 * N_ENVS
    tags = tb(trainer).Tags()
    assert tags["scalars"] == [] and tags["histograms"] == []
    # The event log keeps cumulative per-blueprint counts even with no metrics logged.
    assert callback.events.blueprint_counts == {"conv": {"germinated": 2}, "lora": {"pruned": 2}}


def test_normal_profile_writes_tensorboard_summaries_per_rollout(tmp_path: Path) -> None:
    callback = TelemetryCallback()
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback, rollouts=2)
    acc = tb(trainer)
    scalars = set(acc.Tags()["scalars"])
    expected = {
        "reward/acc_delta",
        "reward/rent",
        "reward/total",
        "stages/TRAINING",
        "stages/DORMANT",
        "blueprints/conv/germinated",
        "blueprints/conv/germinated_total",
        "blueprints/lora/pruned",
        "masks/op",
        "masks/slot",
        "host/val_acc/env0",
        "host/val_acc/env1",
        "actions/op_rate/GERMINATE",
        "lifecycle/refused",
        "lifecycle/rollbacks",
        "lifecycle/discarded_transitions",
    }
    assert expected <= scalars
    assert not any(tag.startswith("debug/") for tag in scalars)
    assert set(acc.Tags()["histograms"]) == {
        f"actions/{h}" for h in ("op", "slot", "blueprint", "blend")
    }

    def values(tag: str) -> list[tuple[int, float]]:
        return [(s.step, s.value) for s in acc.Scalars(tag)]

    # Per-step mean over envs, summed over the episode: (0.4 - 0.2) / 2 * 3 steps.
    assert values("reward/acc_delta") == [(0, pytest.approx(0.3)), (1, pytest.approx(0.3))]
    assert values("stages/TRAINING") == [(0, 1.0), (1, 1.0)]
    assert values("stages/DORMANT") == [(0, 3.0), (1, 3.0)]
    assert values("blueprints/conv/germinated") == [(0, 1.0), (1, 1.0)]
    assert values("blueprints/conv/germinated_total") == [(0, 1.0), (1, 2.0)]
    assert values("masks/op") == [(0, 0.75), (1, 0.75)]
    assert values("lifecycle/refused") == [(0, 1.0), (1, 1.0)]
    assert values("lifecycle/discarded_transitions") == [(0, 2.0), (1, 2.0)]
    assert values("actions/op_rate/WAIT") == [(0, 0.5), (1, 0.5)]
    op_histogram = acc.Histograms("actions/op")[0].histogram_value
    assert op_histogram.num == N_ENVS * STEPS and op_histogram.min == 0 and op_histogram.max == 1


def test_histogram_every_skips_rollouts(tmp_path: Path) -> None:
    callback = TelemetryCallback(histogram_every=2)
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback, rollouts=3)
    steps = [h.step for h in tb(trainer).Histograms("actions/op")]
    assert steps == [0, 2]


def test_debug_profile_writes_per_step_scalars(tmp_path: Path) -> None:
    callback = TelemetryCallback(profile="debug")
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback, rollouts=2)
    acc = tb(trainer)
    steps = [s.step for s in acc.Scalars("debug/reward_step")]
    # Rollout 0 teaches the callback T = 3 decisions per rollout.
    assert steps == [0, 1, 2, 3, 4, 5]
    assert acc.Scalars("debug/reward_step")[0].value == pytest.approx(0.125)
    assert acc.Scalars("debug/val_acc_step")[0].value == pytest.approx(0.55)
    assert "reward/total" in acc.Tags()["scalars"]


def test_debug_profile_flushes_every_step(tmp_path: Path) -> None:
    callback = TelemetryCallback(profile="debug")
    trainer = make_trainer(tmp_path, callback)
    module = LightningModule()
    callback.setup(trainer, module, "fit")
    callback.on_env_step(trainer, module, make_step(0, 0, EVENTS_BY_STEP[0]))
    assert callback.events.events_path is not None
    assert len(read_events(callback.events.events_path)) == 2  # readable before any rollout end
    callback.teardown(trainer, module, "fit")


def csv_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a CSVLogger wrote to ``log_dir``/metrics.csv: name -> [(step, value)]."""
    with open(Path(log_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        step = int(row.pop("step"))
        for name, value in row.items():
            if value != "":
                out.setdefault(name, []).append((step, float(value)))
    return out


def test_csv_logger_gets_the_scalars_tensorboard_gets(tmp_path: Path) -> None:
    on_tb = TelemetryCallback(profile="debug")
    tb_trainer = make_trainer(tmp_path / "tb", on_tb)
    drive(tb_trainer, on_tb, rollouts=2)
    on_csv = TelemetryCallback(profile="debug")
    csv_trainer = make_trainer(tmp_path / "csv", on_csv, logger=CSVLogger(tmp_path / "csv"))
    drive(csv_trainer, on_csv, rollouts=2)

    acc, in_csv = tb(tb_trainer), csv_scalars(csv_trainer.log_dir)  # type: ignore[arg-type]
    assert set(in_csv) == set(acc.Tags()["scalars"])
    for tag in acc.Tags()["scalars"]:
        assert in_csv[tag] == [(s.step, pytest.approx(s.value)) for s in acc.Scalars(tag)], tag
    assert acc.Tags()["histograms"], "TensorBoard alone gets the action histograms"
    assert Path(csv_trainer.log_dir, "events.jsonl").exists()  # type: ignore[arg-type]


def test_scalars_reach_every_configured_logger(tmp_path: Path) -> None:
    callback = TelemetryCallback()
    tensorboard, csv_logger = TensorBoardLogger(tmp_path), CSVLogger(tmp_path)
    trainer = make_trainer(tmp_path, callback, logger=[tensorboard, csv_logger])
    drive(trainer, callback)
    scalars = set(tb(trainer).Tags()["scalars"])
    assert "reward/total" in scalars
    assert set(csv_scalars(csv_logger.log_dir)) == scalars


def test_no_logger_writes_into_default_root_dir(tmp_path: Path) -> None:
    callback = TelemetryCallback(events_file="telemetry/ev.jsonl")
    trainer = Trainer(default_root_dir=tmp_path, logger=False, callbacks=[callback])
    module = LightningModule()
    callback.setup(trainer, module, "fit")
    callback.on_rollout_end(trainer, module, make_summary(0))
    callback.teardown(trainer, module, "fit")
    assert len(read_events(tmp_path / "telemetry" / "ev.jsonl")) == N_ENVS


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"profile": "verbose"}, ValueError, "'minimal', 'normal', 'debug'"),
        ({"events_file": ""}, ValueError, "non-empty file name"),
        ({"histogram_every": 0}, ValueError, ">= 1"),
        ({"histogram_every": 1.5}, TypeError, "int >= 1"),
    ],
)
def test_bad_arguments_say_the_fix(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=rf"TelemetryCallback\(.*{match}"):
        TelemetryCallback(**kwargs)  # type: ignore[arg-type]
    # Each half checks its own arguments and names itself.
    half = EventLogCallback if "histogram_every" not in kwargs else MetricsCallback
    with pytest.raises(error, match=rf"{half.__name__}\(.*{match}"):
        half(**kwargs)  # type: ignore[arg-type]


def test_profiles_and_registry() -> None:
    assert tuple(PROFILES) == ("minimal", "normal", "debug")
    assert CALLBACKS.get("telemetry") is TelemetryCallback
    callback = TelemetryCallback(profile="debug", events_file="ev.jsonl", histogram_every=3)
    assert callback.parts == (callback.events, callback.metrics)
    assert (callback.events.profile, callback.events.events_file) == ("debug", "ev.jsonl")
    assert (callback.metrics.profile, callback.metrics.histogram_every) == ("debug", 3)


def test_the_halves_work_alone(tmp_path: Path) -> None:
    events, metrics = EventLogCallback(profile="minimal"), MetricsCallback()
    trainer = Trainer(
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path),
        callbacks=[events, metrics],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    for callback in (events, metrics):
        drive(trainer, callback, rollouts=2)
    kinds = {e["kind"] for e in read_events(events.events_path)}  # type: ignore[arg-type]
    assert kinds == {"germinated", "pruned", "rollback", "episode_end", "ppo_update"}
    scalars = csv_scalars(trainer.log_dir)  # type: ignore[arg-type]
    assert scalars["blueprints/lora/pruned_total"] == [(0, 1.0), (1, 2.0)]
    assert metrics.blueprint_totals == events.blueprint_counts
    assert metrics.steps_per_rollout == events.steps_per_rollout == STEPS


def test_a_minimal_metrics_callback_logs_nothing(tmp_path: Path) -> None:
    callback = MetricsCallback(profile="minimal")
    trainer = make_trainer(tmp_path, callback)
    drive(trainer, callback)
    assert tb(trainer).Tags()["scalars"] == []


@pytest.mark.parametrize("half", [EventLogCallback, MetricsCallback])
def test_telemetry_beside_one_of_its_own_halves_is_refused(tmp_path: Path, half: type) -> None:
    trainer = make_trainer(tmp_path, TelemetryCallback())
    trainer.callbacks.append(half())
    module = LightningModule()
    with pytest.raises(ValueError, match="not both"):
        for callback in trainer.callbacks:
            callback.setup(trainer, module, "fit")


def test_halves_that_do_not_collide_may_run_beside_telemetry(tmp_path: Path) -> None:
    # Another events file, and metrics beside a telemetry that logs none (minimal).
    trainer = make_trainer(tmp_path, TelemetryCallback(profile="minimal"))
    other, metrics = EventLogCallback(events_file="other.jsonl"), MetricsCallback()
    trainer.callbacks.extend([other, metrics])
    for callback in trainer.callbacks:
        callback.setup(trainer, LightningModule(), "fit")
    assert other.events_path == Path(trainer.log_dir, "other.jsonl")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [TelemetryCallback, EventLogCallback, MetricsCallback])
def test_hooks_before_setup_raise(kind: type) -> None:
    with pytest.raises(RuntimeError, match="callbacks="):
        kind().on_env_step(None, None, make_step(0, 0))


def test_state_dict_round_trip_continues_cumulative_counts(tmp_path: Path) -> None:
    first = TelemetryCallback()
    trainer = make_trainer(tmp_path, first)
    drive(trainer, first, rollouts=2)
    state = json.loads(json.dumps(first.state_dict()))  # plain data, survives any checkpoint
    assert state["version"] == 2 and set(state) == {"version", "events", "metrics"}
    events_state, metrics_state = state["events"], state["metrics"]
    assert events_state["blueprint_counts"] == {"conv": {"germinated": 2}, "lora": {"pruned": 2}}
    assert events_state["events_written"] == first.events.events_written == 20
    assert events_state["rollouts_seen"] == 2 and events_state["steps_per_rollout"] == STEPS
    assert metrics_state["blueprint_totals"] == events_state["blueprint_counts"]
    assert metrics_state["steps_per_rollout"] == STEPS

    resumed = TelemetryCallback()
    assert resumed.state_key == first.state_key
    resumed.load_state_dict(state)
    trainer = make_trainer(tmp_path, resumed, logger=TensorBoardLogger(tmp_path, version=0))
    drive(trainer, resumed, rollouts=1, start=2)
    assert resumed.events.blueprint_counts == {"conv": {"germinated": 3}, "lora": {"pruned": 3}}
    assert resumed.events.rollouts_seen == 3
    events = read_events(resumed.events.events_path)  # type: ignore[arg-type]
    assert resumed.events.events_written == len(events) == 20 + 1 + 10  # after a resume line
    assert events[20]["kind"] == "resume" and events[20]["events_written"] == 20
    assert events[20]["rollout"] == 2
    totals = tb(trainer).Scalars("blueprints/conv/germinated_total")
    assert max((s.step, s.value) for s in totals) == (2, 3.0)

    with pytest.raises(ValueError, match="version"):
        TelemetryCallback().load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="version"):
        EventLogCallback().load_state_dict({**events_state, "version": 99})
    with pytest.raises(ValueError, match="version"):
        MetricsCallback().load_state_dict({**metrics_state, "version": 99})


def test_resume_drops_the_unfinished_rollouts_records(tmp_path: Path) -> None:
    first = TelemetryCallback()
    trainer = make_trainer(tmp_path, first)
    drive(trainer, first, rollouts=2)
    state = first.state_dict()  # as saved after rollout 1; rollout 2 then got cut short
    module = LightningModule()
    first.setup(trainer, module, "fit")
    first.on_rollout_start(trainer, module, 2)
    first.on_env_step(trainer, module, make_step(2, 0, EVENTS_BY_STEP[0]))
    first.teardown(trainer, module, "fit")
    with open(first.events.events_path, "a") as f:  # type: ignore[arg-type]
        f.write('{"kind": "ppo_upd')  # a line the crash cut short

    resumed = TelemetryCallback()
    resumed.load_state_dict(state)
    trainer = make_trainer(tmp_path, resumed, logger=TensorBoardLogger(tmp_path, version=0))
    drive(trainer, resumed, rollouts=1, start=2)
    events = read_events(resumed.events.events_path)  # type: ignore[arg-type]
    assert events[20]["kind"] == "resume" and events[20]["dropped_unfinished"] == 2 + 1
    assert [e["rollout"] for e in events] == [0] * 10 + [1] * 10 + [2] * 11
    assert resumed.events.events_written == 20 + 1 + 10


def test_state_from_before_the_split_still_loads(tmp_path: Path) -> None:
    # The version 1 state TelemetryCallback wrote when it was one class: the event log's.
    old = {
        "version": 1,
        "events_written": 20,
        "events_by_kind": {"germinated": 2, "pruned": 2},
        "blueprint_counts": {"conv": {"germinated": 2}, "lora": {"pruned": 2}},
        "rollouts_seen": 2,
        "steps_per_rollout": STEPS,
    }
    resumed = TelemetryCallback()
    resumed.load_state_dict(old)
    assert resumed.events.state_dict() == old
    assert resumed.metrics.blueprint_totals == old["blueprint_counts"]
    trainer = make_trainer(tmp_path, resumed)
    drive(trainer, resumed, rollouts=1, start=2)
    totals = tb(trainer).Scalars("blueprints/conv/germinated_total")
    assert [(s.step, s.value) for s in totals] == [(2, 3.0)]


class ReadsAParameterEachStep(EsperCallback):
    """A callback that breaks the rule: it reads one value of the policy on every env step."""

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        next(pl_module.policy.parameters()).sum().item()


@dataclass
class CountedFit:
    """Host reads counted over each rollout of a real fit, and what the rollouts reported."""

    trainer: Trainer
    reads: list[int]
    summaries: list[RolloutSummary]
    #: Where each rollout's reads came from, for failure messages.
    reports: list[str]

    @property
    def packed_transfers(self) -> list[int]:
        return [s.packed_transfers for s in self.summaries]

    @property
    def steps(self) -> list[int]:
        """``on_env_step`` calls per rollout: one per decision."""
        return [s.env_steps // len(s.episode_return) for s in self.summaries]

    @property
    def reads_per_step(self) -> list[float]:
        """The counted reads per host epoch, as ``perf/host_reads_per_step`` should log them."""
        return [r / s.host_epochs_per_env for r, s in zip(self.reads, self.summaries, strict=True)]


def fit_counting_rollouts(tmp_path: Path, callbacks: list[Callback]) -> CountedFit:
    """Fit a small real PPOModule with ``callbacks``, each rollout under a HostReadCounter.

    The callbacks' rollout hooks run inside the counted region beside the module's device
    tensors (policy, hosts, buffer), so a hook that read one of them would be counted.
    """
    from esper.simic.module import PPOModule
    from esper.tolaria.data import SyntheticImageDataModule

    seed_everything(0, verbose=False)
    module = PPOModule(n_envs=REAL_ENVS, episode_epochs=REAL_EPISODE_EPOCHS, host_kwargs=REAL_HOST)
    counted = count_rollout_reads(module)
    trainer = Trainer(
        max_epochs=REAL_ROLLOUTS,
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(tmp_path),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, datamodule=SyntheticImageDataModule(**REAL_DATA))
    assert len(counted.reads) == REAL_ROLLOUTS
    return CountedFit(trainer, counted.reads, counted.summaries, counted.reports)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_hooks_in_a_real_rollout_add_no_host_reads_to_the_packed_transfers(
    tmp_path: Path, profile: str
) -> None:
    callback = TelemetryCallback(profile=profile)
    fit = fit_counting_rollouts(tmp_path, [callback])
    # In "debug" the callback's own counter runs nested inside this one; both must agree.
    assert fit.reads == fit.packed_transfers, fit.reports
    assert callback.events.rollouts_seen == REAL_ROLLOUTS
    if profile == PROFILE_DEBUG:
        assert callback.metrics.last_host_reads is not None
        assert callback.metrics.last_host_reads.count == fit.reads[-1], (
            callback.metrics.last_host_reads.report()
        )
    else:
        assert callback.metrics.last_host_reads is None


def test_the_real_rollout_harness_catches_a_hook_that_reads_a_device_tensor(
    tmp_path: Path,
) -> None:
    fit = fit_counting_rollouts(tmp_path, [TelemetryCallback(), ReadsAParameterEachStep()])
    extra = [r - t for r, t in zip(fit.reads, fit.packed_transfers, strict=True)]
    assert extra == fit.steps, "one counted read per on_env_step of the reading callback"


class RaisesOnEnvStep(EsperCallback):
    """A callback whose hook fails mid-rollout, so the rollout never reaches its end."""

    def on_env_step(self, trainer: Trainer, pl_module: LightningModule, step: StepBatch) -> None:
        raise ValueError("boom")


def test_debug_profile_ends_its_counter_when_a_rollout_raises(tmp_path: Path) -> None:
    originals = {name: getattr(torch.Tensor, name) for name in WRAPPED_METHODS}
    modes = torch._C._len_torch_dispatch_stack()
    callback = TelemetryCallback(profile=PROFILE_DEBUG)
    with pytest.raises(Exception, match="boom"):  # however the module wraps it
        fit_counting_rollouts(tmp_path, [callback, RaisesOnEnvStep()])
    assert {name: getattr(torch.Tensor, name) for name in WRAPPED_METHODS} == originals
    assert torch._C._len_torch_dispatch_stack() == modes
    assert callback.metrics.last_host_reads is not None, "the counter was ended, not left running"


def logged(trainer: Trainer, tag: str) -> list[float]:
    """Values of the TensorBoard scalar ``tag``, in step order."""
    return [event.value for event in tb(trainer).Scalars(tag)]


@pytest.mark.slow
def test_debug_profile_logs_measured_host_reads_equal_to_packed_transfers(
    tmp_path: Path,
) -> None:
    fit = fit_counting_rollouts(tmp_path, [TelemetryCallback(profile=PROFILE_DEBUG)])
    measured = logged(fit.trainer, HOST_READS_TAG)
    assert measured == pytest.approx(fit.reads_per_step)
    assert measured == logged(fit.trainer, PACKED_TRANSFERS_TAG)


@pytest.mark.slow
def test_debug_profile_measures_a_hook_that_reads_a_device_tensor(tmp_path: Path) -> None:
    fit = fit_counting_rollouts(
        tmp_path, [TelemetryCallback(profile=PROFILE_DEBUG), ReadsAParameterEachStep()]
    )
    measured = logged(fit.trainer, HOST_READS_TAG)
    counted = logged(fit.trainer, PACKED_TRANSFERS_TAG)
    assert measured == pytest.approx(fit.reads_per_step)
    assert len(counted) == REAL_ROLLOUTS
    assert all(m > c for m, c in zip(measured, counted, strict=True)), (measured, counted)


@pytest.mark.slow
def test_real_fit_writes_events_and_tensorboard(tmp_path: Path) -> None:
    from esper.simic.module import PPOModule
    from esper.tolaria.data import SyntheticImageDataModule

    callback = TelemetryCallback()
    trainer = Trainer(
        max_epochs=2,
        default_root_dir=tmp_path,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        PPOModule(n_envs=2, episode_epochs=3, host_kwargs={"channels": [4, 8]}),
        datamodule=SyntheticImageDataModule(n_train=64, n_val=32, batch_size=16),
    )
    events = read_events(Path(trainer.log_dir) / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("episode_end") == 2 * 2
    assert kinds.count("ppo_update") == 2, (
        "no ppo_update lines: PPOModule does not call on_ppo_update_end yet"
    )
    scalars = tb(trainer).Tags()["scalars"]
    assert any(tag.startswith("reward/") for tag in scalars), scalars
    assert callback.events.rollouts_seen == 2


def real_fit(root: Path, logger: object, profile: str) -> Trainer:
    """A short real fit of a small PPOModule with telemetry at ``profile``, logging to ``logger``."""
    from esper.simic.module import PPOModule
    from esper.tolaria.data import SyntheticImageDataModule

    seed_everything(0, verbose=False)
    trainer = Trainer(
        max_epochs=REAL_ROLLOUTS,
        default_root_dir=root,
        logger=logger,  # type: ignore[arg-type]
        callbacks=[TelemetryCallback(profile=profile)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = PPOModule(n_envs=REAL_ENVS, episode_epochs=REAL_EPISODE_EPOCHS, host_kwargs=REAL_HOST)
    trainer.fit(module, datamodule=SyntheticImageDataModule(**REAL_DATA))
    return trainer


@pytest.mark.slow
def test_real_fit_logs_the_same_scalar_names_to_csv_as_to_tensorboard(tmp_path: Path) -> None:
    # default_hp_metric=False: TensorBoard's placeholder for hparams, not a logged scalar.
    tensorboard = TensorBoardLogger(tmp_path / "tb", default_hp_metric=False)
    on_tb = real_fit(tmp_path / "tb", tensorboard, PROFILE_DEBUG)
    on_csv = real_fit(tmp_path / "csv", CSVLogger(tmp_path / "csv"), PROFILE_DEBUG)
    tb_names = set(tb(on_tb).Tags()["scalars"])
    csv_names = set(csv_scalars(on_csv.log_dir))  # type: ignore[arg-type]
    # The callback's names and the module's (self.log) alike reach the CSV file.
    assert {"reward/total", "host/val_acc/env0", HOST_READS_TAG, "debug/reward_step"} <= tb_names
    assert {"train/episode_return", PACKED_TRANSFERS_TAG} <= tb_names
    assert csv_names == tb_names
