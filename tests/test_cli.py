"""`esper fit` end to end, and `esper plugins`."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from esper.cli import main
from esper.kasmina import LifecycleConfig, OptimConfig
from esper.mdp.rewards import RewardConfig
from esper.simic.module import PPOModule
from esper.simic.normalizer import NormalizerConfig
from esper.simic.ppo import PPOConfig
from esper.tamiyo.policy import PolicyConfig
from esper.tolaria.data import (
    Cifar10DataModule,
    DigitsDataModule,
    SyntheticImageDataModule,
    TokenSequenceDataModule,
)

#: The scalars a user watching TensorBoard is promised.
PROMISED_SCALARS = (
    "train/episode_return",
    "train/host_val_acc",
    "train/seeds_fossilized",
    "train/params_added",
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/entropy",
    "ppo/approx_kl",
    "ppo/clip_fraction",
    "ppo/explained_variance",
    "perf/env_steps_per_s",
)

TINY_CONFIG = """\
model:
  n_envs: 2
  episode_epochs: 3
  host_kwargs:
    channels: [4, 8]
data:
  class_path: esper.tolaria.data.SyntheticImageDataModule
  init_args:
    n_train: 64
    n_val: 32
    batch_size: 16
trainer:
  max_epochs: 2
  enable_progress_bar: false
"""


@pytest.fixture(autouse=True)
def _console_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if typed at a console: LightningCLI warns when pytest's own argv is present."""
    monkeypatch.setattr("sys.argv", ["esper"])


@pytest.mark.slow
def test_fit_writes_the_promised_scalars_and_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    root = tmp_path / "run"
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(root)]) == 0

    events = list(root.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {root}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    missing = [s for s in PROMISED_SCALARS if s not in tags]
    assert not missing, f"missing scalars {missing}; logged: {sorted(tags)}"
    assert len(acc.Scalars("ppo/policy_loss")) == 2  # one point per PPO update

    assert list(root.rglob("*.ckpt")), "no checkpoint written"
    out = capsys.readouterr().out
    assert "esper fit: 2 PPO update(s)" in out
    assert "host val accuracy" in out and "parameters added" in out


#: One bad value per config family, and the key ``esper fit`` must name it by.
BAD_VALUES: dict[str, list[str]] = {
    "model.n_envs": ["--model.n_envs", "0"],  # EnvConfig
    "model.ent_coef_final": ["--model.ent_coef_final", "-1"],  # PPOModule itself
    "model.ppo.clip_coef": ["--model.ppo.clip_coef", "-1"],
    "model.policy.hidden_size": ["--model.policy.hidden_size", "0"],
    "model.rewards.param_budget": ["--model.rewards.param_budget", "0"],
    "model.lifecycle.blend_epochs": ["--model.lifecycle.blend_epochs", "0"],
    "model.host_optim.momentum": ["--model.host_optim.momentum", "1.5"],
    "model.normalizer.clip": ["--model.normalizer.clip", "0"],
    "data.batch_size": ["--data.batch_size", "0"],  # every data module's argument
    "data.val_fraction": ["--data.val_fraction", "1.5"],  # the digits module's own
    "callbacks": ["--callbacks", "[no_such_callback]"],
    "model.devices": ["--model.devices", '["banana"]'],
    # Checked when the run starts, against the ranks: PPOModule.setup's validate_run.
    "model.ppo.n_minibatches": ["--model.n_envs", "2", "--model.ppo.n_minibatches", "3"],
}


@pytest.mark.parametrize(("key", "args"), BAD_VALUES.items(), ids=list(BAD_VALUES))
def test_fit_reports_a_bad_config_value_by_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, args: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fit", *args, "--trainer.default_root_dir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"esper fit: error: {key}: "), err
    assert "Traceback" not in "\n".join(err)
    assert not list(tmp_path.iterdir()), "a refused run left files behind"


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line ``esper fit ARGS`` is refused with (exit 2, no traceback, no files)."""
    with pytest.raises(SystemExit) as exited:
        main(["fit", *args, "--trainer.default_root_dir", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert not list(tmp_path.iterdir()), "a refused run left files behind"
    return err[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_fit_asking_for_a_gpu_where_there_is_none_names_the_accelerator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning said "No supported gpu backend found!" in a traceback."""
    line = _refused(tmp_path, capsys, "--trainer.accelerator", "gpu")
    assert line.startswith("esper fit: error: trainer.accelerator: 'gpu' asks for a GPU"), line
    assert "use cpu, or auto" in line
    # Hosts placed on a GPU: refused before any is built (was a RunFailure at update 1).
    line = _refused(tmp_path, capsys, "--model.devices", '["cpu", "cuda:0"]')
    assert line.startswith("esper fit: error: model.devices: names cuda:0, which this"), line


def test_fit_names_a_root_folder_it_cannot_write_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder under a file: the line said only "[Errno 20] Not a directory: ..."."""
    (tmp_path / "file").write_text("not a folder")
    root = tmp_path / "file" / "runs"
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--trainer.default_root_dir", str(root)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"esper fit: error: trainer.default_root_dir: cannot write runs in {root}: "
    ), err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_fit_refuses_a_callback_named_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning refused the second TelemetryCallback in a traceback."""
    line = _refused(tmp_path, capsys, "--callbacks", "[telemetry, governor, telemetry]")
    assert line == (
        "esper fit: error: callbacks: names ['telemetry'] more than once; name each callback once"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--trainer.strategy", "nonsense"], "strategy='nonsense'"),
        (["--trainer.accelerator", "cpu", "--trainer.devices", "0"], "devices='0'"),
    ],
    ids=["strategy", "devices"],
)
def test_fit_says_in_one_line_what_lightning_refuses_of_the_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    line = _refused(tmp_path, capsys, *args)
    assert line.startswith("esper fit: error: trainer: Lightning refused the trainer ("), line
    assert says in line


TOKENS = "esper.tolaria.data.TokenSequenceDataModule"
TINY_TOKEN_RUN = [
    "--model.host",
    "transformer",
    "--model.n_envs",
    "2",
    "--model.episode_epochs",
    "2",
    "--trainer.max_epochs",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--data.n_train",
    "64",
    "--data.n_val",
    "32",
    "--data.batch_size",
    "16",
]


@pytest.mark.slow
def test_choosing_another_data_class_takes_its_own_defaults_not_the_digits_ones(
    tmp_path: Path,
) -> None:
    """jsonargparse carries the default class's init args over; digits' val_fraction
    would make synthetic tokens refuse to start."""
    root = tmp_path / "run"
    args = ["fit", "--data", TOKENS, *TINY_TOKEN_RUN, "--trainer.default_root_dir", str(root)]
    assert main(args) == 0
    saved = next(root.rglob("config.yaml")).read_text()
    assert "val_fraction: null" in saved


def test_a_value_the_user_gives_is_never_dropped_as_carried_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ["--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--data", TOKENS, "--data.val_fraction", "0.2", *TINY_TOKEN_RUN, *root])
    assert exited.value.code == 2
    assert "data.val_fraction: applies only with text_path" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "cls"), [("tokens", "TokenSequenceDataModule"), ("digits", "DigitsDataModule")]
)
@pytest.mark.parametrize("form", ["--data NAME", "--data=NAME"])
def test_data_takes_the_registry_names_esper_plugins_lists(
    name: str, cls: str, form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fit", *form.replace("NAME", name).split(), "--print_config"])
    assert exited.value.code == 0
    assert f".{cls}" in capsys.readouterr().out.split("data:", 1)[1].splitlines()[1]


@pytest.mark.slow
def test_saved_config_holds_every_resolved_value_and_repeats_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG.replace("max_epochs: 2", "max_epochs: 1"))
    root = tmp_path / "run"
    args = ["--config", str(config), "--model.ppo.lr", "0.002"]
    assert main(["fit", *args, "--trainer.default_root_dir", str(root)]) == 0
    saved_path = next(root.rglob("config.yaml"))
    model = yaml.safe_load(saved_path.read_text())["model"]
    for key in ("lifecycle", "host_optim", "rewards", "policy", "ppo", "normalizer"):
        assert isinstance(model[key], dict) and model[key], f"model.{key} saved as {model[key]}"
    assert model["ppo"]["lr"] == 0.002 and model["ppo"]["clip_coef"] == PPOConfig().clip_coef
    assert model["host_kwargs"] == {"channels": [4, 8]}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # the saved file alone is a valid config
        main(["fit", "--config", str(saved_path), "--print_config"])
    assert exited.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["ppo"] == model["ppo"]


def test_fit_help_offers_no_options_that_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert "--model.ppo" in shown
    assert "--optimizer" not in shown and "--lr_scheduler" not in shown


def _help_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["fit", *args])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _descriptions(shown: str, prefix: str) -> dict[str, str]:
    """Each option ``PREFIX NAME`` in the help text -> its description: the help text
    before jsonargparse's ``(type: ...)``, on the option's line or the lines below it."""
    found: dict[str, str] = {}
    for entry in re.split(r"\n(?=  -)", shown):
        first, _, rest = entry.split("\n\n")[0].partition("\n")
        name = re.match(rf"\s*{re.escape(prefix)}(\w+)(?=[\s,]|$)", first)
        if name is None:
            continue
        beside = re.split(r"\s{2,}", first.strip(), maxsplit=1)[1:]
        text = " ".join(" ".join([*beside, rest]).split())
        found[name.group(1)] = re.split(r"\((?:required, )?type:", text)[0].strip()
    return found


#: ``--model.<key>``: the config dataclass behind each of PPOModule's nested configs.
MODEL_CONFIGS = {
    "lifecycle": LifecycleConfig,
    "host_optim": OptimConfig,
    "rewards": RewardConfig,
    "policy": PolicyConfig,
    "ppo": PPOConfig,
    "normalizer": NormalizerConfig,
}


@pytest.mark.parametrize(("key", "config"), MODEL_CONFIGS.items(), ids=list(MODEL_CONFIGS))
def test_every_config_field_has_a_description_in_its_help(
    key: str, config: type, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = _help_of([f"--model.{key}.help"], capsys)
    described = _descriptions(shown, f"--model.{key}.")
    for field in dataclasses.fields(config):
        assert described.get(field.name), f"--model.{key}.{field.name} has no description"


def _init_params(cls: type) -> list[str]:
    """The CLI options of ``cls``: its own parameters and, where it passes ``**kwargs`` on
    to its base (as jsonargparse follows them), the base's."""
    params = inspect.signature(cls.__init__).parameters.values()
    names = [p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        names += [n for n in _init_params(cls.__mro__[1]) if n not in names]
    return names


def test_every_model_option_has_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    described = _descriptions(_help_of(["--help"], capsys), "--model.")
    for name in _init_params(PPOModule):
        assert described.get(name), f"--model.{name} has no description"


@pytest.mark.parametrize(
    "datamodule",
    [DigitsDataModule, SyntheticImageDataModule, TokenSequenceDataModule, Cifar10DataModule],
    ids=lambda cls: cls.__name__,
)
def test_every_data_option_has_a_description(
    datamodule: type, capsys: pytest.CaptureFixture[str]
) -> None:
    described = _descriptions(_help_of(["--data.help", datamodule.__name__], capsys), "--data.")
    for name in _init_params(datamodule):
        assert described.get(name), f"--data.{name} of {datamodule.__name__} has no description"


def test_fit_help_shows_esper_options_before_the_trainer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = _help_of(["--help"], capsys)
    # A group is its title (a line of its own ending in ":") and the options below it.
    groups = re.findall(r"^(\S[^\n]*:)\n((?:  [^\n]*\n?)*)", shown, flags=re.MULTILINE)
    titles = [title for title, _ in groups if not title.startswith("usage:")]

    def group_of(option: str) -> str:
        return next(t for t, body in groups if re.search(rf"^  {re.escape(option)}\b", body, re.M))

    esper = [group_of("--callbacks"), group_of("--model.n_envs"), group_of("--data")]
    assert titles[: len(esper)] == esper, titles
    assert titles.index(group_of("--trainer.max_epochs")) > titles.index(esper[-1]), titles


def test_fit_prints_one_plain_line_per_update_when_stdout_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG.replace("  enable_progress_bar: false\n", ""))
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("update ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], out
    assert all("steps/s" in line and "val acc" in line for line in lines)
    assert "\r" not in out  # no bar redrawn in place


def test_fit_on_a_terminal_shows_a_bar_over_each_updates_host_epochs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG.replace("  enable_progress_bar: false\n", ""))
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)]) == 0
    frames = capsys.readouterr().out.replace("\n", "\r").split("\r")
    bars = [f for f in frames if "host epoch" in f]
    # While update 2 runs, the bar counts its host epochs (3 per episode) and shows the
    # figures of update 1, which finished.
    during = [f for f in bars if f.startswith("update 2/2") and "2/3" in f]
    assert during, bars
    assert "return +" in during[-1] and "approx_kl" in during[-1], during[-1]
    assert any(f.startswith("update 1/2") and "PPO update" in f for f in bars), bars
    assert not any(line.startswith("update ") and "steps/s" in line for line in frames)


def test_fit_writes_its_checkpoints_through_the_esper_checkpoint_io_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from esper.callbacks.checkpoint import EsperCheckpointIO

    saved: list[str] = []
    original = EsperCheckpointIO.save_checkpoint

    def counting(self: EsperCheckpointIO, checkpoint: dict, path: object, **kwargs: object) -> None:
        saved.append(Path(str(path)).name)
        original(self, checkpoint, path, **kwargs)

    monkeypatch.setattr(EsperCheckpointIO, "save_checkpoint", counting)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    assert main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)]) == 0
    assert saved.count("last.ckpt") == 2, saved  # one per update, through the plugin


def test_a_checkpoint_io_the_run_brings_is_kept() -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from esper.callbacks.checkpoint import EsperCheckpointIO
    from esper.cli.options import with_checkpoint_io

    own = TorchCheckpointIO()
    assert with_checkpoint_io([own]) == [own]
    (added,) = with_checkpoint_io(None)
    assert isinstance(added, EsperCheckpointIO)


def test_plugins_lists_every_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    groups = ("blueprints", "hosts", "datamodules", "rewards", "callbacks")
    for group in groups:  # every group the README lists
        assert f"esper.{group}" in out
    assert "conv_light" in out and "digits" in out and "sparse" in out
    # One column for the sources, wide enough for the longest name (last_checkpoint).
    starts = {line.index("esper (built-in)") for line in out.splitlines() if "(built-in)" in line}
    assert len(starts) == 1, out


@pytest.mark.parametrize("words", [["--help"], ["evaluate", "--help"], ["report", "--help"]])
def test_help_outside_fit_starts_without_importing_lightning_or_torch(words: list[str]) -> None:
    probe = (
        "import sys\n"
        "from esper.cli import main\n"
        "try:\n"
        f"    main({words!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("where", ["nowhere", "empty_run"])
def test_report_without_event_logs_is_one_line_naming_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Said once: the command's prefix, then the reason (it was "esper report: error:
    esper report: no events.jsonl ...")."""
    (tmp_path / "empty_run").mkdir()
    assert main(["report", str(tmp_path / where)]) == 1
    shown = capsys.readouterr().err.strip().splitlines()
    assert len(shown) == 1 and shown[0].startswith("esper report: error: "), shown
    assert shown[0].count("esper report") == 1 and where in shown[0], shown
