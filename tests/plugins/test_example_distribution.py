"""The example plugin distribution (examples/esper-example-plugin) installs and plugs in.

The package is built and installed by pip, without network and without build isolation,
into a temporary ``--target`` directory that is put on ``sys.path`` for this module only;
the registries then find its entry points exactly as they would in a real environment.
Afterwards the directory, the imported modules and the registered names are all removed.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from esper.callbacks import CALLBACKS
from esper.callbacks.base import EsperCallback
from esper.contracts import BlendMode, SeedStage
from esper.contracts.rollout import LifecycleEvent, RolloutSummary, StepBatch
from esper.kasmina import (
    BLUEPRINTS,
    BlueprintFitError,
    CNNHost,
    GateSignals,
    GrowingHost,
    LifecycleConfig,
    SlotShape,
)
from esper.kasmina.blueprints import blueprints_fitting
from esper.plugins import BUILTIN_SOURCE

REPO_ROOT = Path(__file__).parents[2]
EXAMPLE = REPO_ROOT / "examples" / "esper-example-plugin"
DIST = "esper-example-plugin 0.1.0"
PACKAGE = "esper_example_plugin"
BLUEPRINT = "squeeze_excite"
CALLBACK = "seed_counter"

#: setuptools builds wheels without the separate ``wheel`` package from this version on.
SETUPTOOLS_BUILDS_WHEELS = (70, 1)

#: Walks a seed to BLENDING at once, where alpha is already 1.
FAST = LifecycleConfig(min_training_epochs=0, blend_epochs=1)
GOOD = GateSignals(grads_finite=True, contribution=1.0)


def _missing_build_tools() -> list[str]:
    """What ``pip install --no-build-isolation`` of a setuptools project lacks here."""
    missing = []
    # Ask the installed metadata, not the import system: on Python < 3.12 looking up the
    # module "pip" makes setuptools' distutils shim fall back to the stdlib distutils for
    # the rest of the process, and torch.compile's C++ build then fails in later tests.
    try:
        version("pip")
    except PackageNotFoundError:
        missing.append("pip")
    try:
        setuptools_version = version("setuptools")
    except PackageNotFoundError:
        return [*missing, "setuptools>=70.1"]
    major_minor = tuple(int(n) for n in re.findall(r"\d+", setuptools_version)[:2])
    if major_minor < SETUPTOOLS_BUILDS_WHEELS and importlib.util.find_spec("wheel") is None:
        missing.append(f"wheel (setuptools {setuptools_version} < 70.1 needs it to build wheels)")
    return missing


def _plugin_modules() -> list[str]:
    return [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]


def _reload_registries() -> None:
    importlib.invalidate_caches()
    BLUEPRINTS.reload_entry_points()
    CALLBACKS.reload_entry_points()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example installed into a fresh ``--target`` directory on ``sys.path``."""
    missing = _missing_build_tools()
    if missing:
        pytest.skip(
            "installing the example plugin with --no-build-isolation needs "
            f"{', '.join(missing)} in this environment ({sys.executable})"
        )
    root = tmp_path_factory.mktemp("example-plugin")
    # Build from a copy: setuptools builds in the source tree and would leave build/ and
    # *.egg-info behind in examples/.
    source = shutil.copytree(
        EXAMPLE,
        root / "source",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    target = root / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--quiet",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"pip could not install {EXAMPLE} (exit {result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )

    assert not _plugin_modules(), "the example plugin was imported before it was installed"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        try:
            _reload_registries()
            yield target
        finally:
            mp.undo()  # takes the directory off sys.path
            for module in _plugin_modules():
                del sys.modules[module]
            _reload_registries()

    assert BLUEPRINT not in BLUEPRINTS
    assert CALLBACK not in CALLBACKS
    assert importlib.util.find_spec(PACKAGE) is None


def _module(site: Path, name: str) -> ModuleType:
    module = importlib.import_module(f"{PACKAGE}.{name}")
    assert Path(module.__file__ or "").is_relative_to(site)  # the installed copy, not examples/
    return module


# ------------------------------------------------------------------ blueprint


def test_blueprint_is_registered_under_its_distribution(site: Path) -> None:
    assert BLUEPRINT in BLUEPRINTS.names()
    entry = BLUEPRINTS.entry(BLUEPRINT)
    assert entry.source == DIST
    assert entry.obj is _module(site, "blueprints").SQUEEZE_EXCITE
    assert entry.obj.host_kinds == frozenset({"cnn"})
    assert BLUEPRINTS.entry("conv_light").source == BUILTIN_SOURCE


def test_blueprint_fits_cnn_slots_with_enough_channels_only(site: Path) -> None:
    bp = BLUEPRINTS.get(BLUEPRINT)
    reduction = _module(site, "blueprints").SE_REDUCTION
    for host in (CNNHost((1, 8, 8)), CNNHost((3, 32, 32))):
        for slot in host.iter_slots():
            assert BLUEPRINT in blueprints_fitting(slot.shape)

    too_narrow = SlotShape("cnn", reduction - 1, (8, 8))
    assert not bp.fits(too_narrow)
    assert f"at least {reduction} channels" in (bp.why_not(too_narrow) or "")
    with pytest.raises(BlueprintFitError, match=BLUEPRINT):
        bp.instantiate(too_narrow)
    assert not bp.fits(SlotShape("transformer", 32, (8,), causal=True))


@pytest.mark.parametrize("channels", [4, 7, 16, 64])
def test_blueprint_param_count_matches_the_built_module(site: Path, channels: int) -> None:
    bp = BLUEPRINTS.get(BLUEPRINT)
    shape = SlotShape("cnn", channels, (4, 4))
    assert bp.param_count(shape) == sum(p.numel() for p in bp.instantiate(shape).parameters())


@pytest.mark.parametrize("blend", [BlendMode.LINEAR, BlendMode.GATED], ids=lambda m: m.name)
def test_blueprint_germinates_in_a_cnn_host_without_changing_its_output(
    site: Path, blend: BlendMode
) -> None:
    torch.manual_seed(0)
    grown = GrowingHost(CNNHost((1, 8, 8), channels=(8, 16), lifecycle=FAST))
    host = grown.model
    host.eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        before = host(x)

    bp = BLUEPRINTS.get(BLUEPRINT)
    for slot in host.iter_slots():
        seed = grown.germinate(slot.slot_id, BLUEPRINT, blend)
        assert slot.stage is SeedStage.GERMINATED
        assert slot.lifecycle.blueprint == BLUEPRINT
        assert slot.slot_id in grown.seed_optimizers
        assert sum(p.numel() for p in seed.parameters()) == bp.param_count(slot.shape)
        with torch.no_grad():
            h = torch.randn(2, slot.shape.channels, *slot.shape.spatial)
            delta = seed(h)
        assert delta.shape == h.shape
        assert not delta.any()
    with torch.no_grad():
        assert torch.equal(host(x), before)

    # Blended in at alpha 1, the zero-initialised seed still leaves the output unchanged...
    for slot in host.iter_slots():
        assert grown.advance(slot.slot_id, GOOD)  # -> TRAINING
        assert grown.advance(slot.slot_id, GOOD)  # -> BLENDING
        assert slot.stage is SeedStage.BLENDING and slot.alpha == 1.0
    with torch.no_grad():
        assert torch.equal(host(x), before)
    # ...and its zeroed last layer still receives a gradient, so it can learn.
    host.train()
    host(x).square().mean().backward()
    for slot in host.iter_slots():
        assert slot.seed is not None
        assert slot.seed.excite.weight.grad is not None
        assert slot.seed.excite.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------ callback


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int | None]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((dict(metrics), step))


def _step(rollout: int, step: int, events: tuple[LifecycleEvent, ...], n_envs: int = 2) -> Any:
    zeros = np.zeros(n_envs, dtype=np.float32)
    flags = np.zeros(n_envs, dtype=bool)
    return StepBatch(
        rollout=rollout,
        step=step,
        host_epoch=step,
        actions=np.zeros((n_envs, 4), dtype=np.int64),
        log_probs=zeros,
        values=zeros,
        applied=flags,
        refused=flags,
        illegal=flags,
        rewards=zeros,
        reward_components={},
        train_loss=zeros,
        val_loss=zeros,
        val_acc=zeros,
        next_val_acc=zeros,
        loss_finite=~flags,
        contribution=np.zeros((n_envs, 2), dtype=np.float32),
        seed_params=np.zeros(n_envs, dtype=np.int64),
        legal_ops=np.ones(n_envs, dtype=np.int64),
        done=flags,
        events=events,
    )


def _summary(rollout: int, n_envs: int = 2) -> RolloutSummary:
    counts = np.zeros(n_envs, dtype=np.int64)
    return RolloutSummary(
        rollout=rollout,
        episode_return=np.zeros(n_envs, dtype=np.float32),
        final_val_acc=np.zeros(n_envs, dtype=np.float32),
        seeds_germinated=counts,
        seeds_fossilized=counts,
        seeds_pruned=counts,
        params_added=counts,
        env_steps=2 * n_envs,
        seconds=1.0,
        seconds_training_hosts=0.5,
        packed_transfers=3,
    )


def _event(kind: str, env: int, slot: str = "stage0") -> LifecycleEvent:
    return LifecycleEvent(kind, env, slot=slot, blueprint=BLUEPRINT)


def test_callback_is_registered_under_its_distribution(site: Path) -> None:
    assert CALLBACK in CALLBACKS.names()
    entry = CALLBACKS.entry(CALLBACK)
    assert entry.source == DIST
    assert entry.obj is _module(site, "callbacks").SeedCounter
    assert issubclass(entry.obj, EsperCallback)


def test_callback_counts_events_per_rollout_and_logs_them(site: Path) -> None:
    counter = CALLBACKS.get(CALLBACK)()
    logger = RecordingLogger()
    trainer, module = SimpleNamespace(loggers=[logger]), SimpleNamespace()

    counter.on_rollout_start(trainer, module, 0)
    counter.on_env_step(
        trainer,
        module,
        _step(0, 0, (_event("germinated", 0), _event("germinated", 1), _event("refused", 1))),
    )
    counter.on_env_step(
        trainer,
        module,
        _step(0, 1, (_event("advanced", 0), _event("fossilized", 0), _event("pruned", 1))),
    )
    counter.on_env_step(trainer, module, _step(0, 2, ()))
    counter.on_rollout_end(trainer, module, _summary(0))
    assert logger.logged == [
        (
            {
                "seed_counter/germinated": 2.0,
                "seed_counter/fossilized": 1.0,
                "seed_counter/germinated_total": 2.0,
                "seed_counter/fossilized_total": 1.0,
            },
            0,
        )
    ]

    # The next rollout starts from zero; the totals carry on. No on_rollout_start this
    # time: the counts are reset at the end of each rollout as well.
    counter.on_env_step(trainer, module, _step(1, 0, (_event("germinated", 1, "stage1"),)))
    counter.on_rollout_end(trainer, module, _summary(1))
    metrics, step = logger.logged[-1]
    assert step == 1
    assert metrics["seed_counter/germinated"] == 1.0
    assert metrics["seed_counter/fossilized"] == 0.0
    assert metrics["seed_counter/germinated_total"] == 3.0
    assert counter.last_metrics == metrics
    assert counter.rollouts == 2


def test_callback_state_survives_a_checkpoint_and_runs_without_a_logger(site: Path) -> None:
    cls = CALLBACKS.get(CALLBACK)
    counter = cls(prefix="seeds")
    trainer, module = SimpleNamespace(loggers=[]), SimpleNamespace()
    counter.on_env_step(trainer, module, _step(0, 0, (_event("germinated", 0),)))
    counter.on_rollout_end(trainer, module, _summary(0))
    counter.on_env_step(trainer, module, _step(1, 0, (_event("fossilized", 0),)))

    resumed = cls(prefix="seeds")
    resumed.load_state_dict(counter.state_dict())
    assert resumed.state_dict() == counter.state_dict()
    assert resumed.state_key == counter.state_key != cls().state_key
    resumed.on_rollout_end(trainer, module, _summary(1))
    assert resumed.last_metrics == {
        "seeds/germinated": 0.0,
        "seeds/fossilized": 1.0,
        "seeds/germinated_total": 1.0,
        "seeds/fossilized_total": 1.0,
    }


@pytest.mark.slow
def test_esper_fit_enables_the_plugins_by_name(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from esper.cli import main
    from tests.test_cli import TINY_CONFIG

    monkeypatch.setattr("sys.argv", ["esper"])
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    root = tmp_path / "run"
    argv = [
        "fit",
        "--config",
        str(config),
        "--trainer.default_root_dir",
        str(root),
        "--callbacks",
        "[telemetry, seed_counter]",
        "--model.blueprints",
        "[squeeze_excite, conv_light]",
    ]
    assert main(argv) == 0
    events = next(root.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert "seed_counter/germinated" in acc.Tags()["scalars"]
