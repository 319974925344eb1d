"""Checkpoints through the ``esper`` command, as a user meets them at a console.

Every file ``esper fit`` writes loads with ``weights_only=True``; a run resumes from any
checkpoint path; and every bad input (checkpoint file, data path) ends in one line that
names the file, a non-zero exit status, no traceback and nothing new on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from esper.cli.lightning_cli import INTERRUPTED_STATUS
from esper.simic.ppo import PPOConfig
from tests.test_cli import TINY_CONFIG

#: Optimiser steps in one PPO update with the default PPOConfig.
STEPS_PER_UPDATE = PPOConfig().update_epochs * PPOConfig().n_minibatches
#: Generous for a tiny run on 2 busy CPU cores.
TIMEOUT_S = 300
#: The run folder of the first run under a root: its checkpoints, events and evaluation.
RUN0 = Path("lightning_logs") / "version_0"
#: A blueprint a "plugin" adds after a checkpoint was written: the action space changes.
PLUGIN_BLUEPRINT = "conv_light_from_plugin"


def esper(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``esper ARGS`` in a fresh process, stdout and stderr together as a console shows them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "esper.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


def esper_here(
    *args: str, cwd: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``esper ARGS`` in this process, its console output read at the file descriptors
    (Lightning's log handlers too): the same check as :func:`esper` without a fresh
    interpreter's start (about 4 s each here). Runs that must be a console's own process
    (a plugin imported first, a signal, a kill) use :func:`esper`."""
    from esper.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "200")
    # The arguments go to main(); an argv of its own would make LightningCLI warn that it
    # was given both.
    monkeypatch.setattr(sys, "argv", ["esper"])
    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["esper", *args], code, out + err)


def lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.strip()]


#: ``esper ARGS`` run somewhere (``cwd``), its console output and exit status returned.
Esper = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def here(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Esper:
    """:func:`esper_here` bound to this test's capture and patches."""
    return functools.partial(esper_here, capfd=capfd, monkeypatch=monkeypatch)


def fit(
    run: Esper, root: Path, *extra: str, max_epochs: int = 1
) -> subprocess.CompletedProcess[str]:
    result = try_fit(run, root, *extra, max_epochs=max_epochs)
    assert result.returncode == 0, result.stdout
    return result


def try_fit(
    run: Esper, root: Path, *extra: str, max_epochs: int = 1
) -> subprocess.CompletedProcess[str]:
    """``esper fit`` of the tiny config into ``root`` by ``run``, whatever its exit status."""
    config = root.parent / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    return run(
        "fit",
        "--config",
        str(config),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.max_epochs",
        str(max_epochs),
        *extra,
        cwd=root.parent,
    )


def policy_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints folder of a finished 1-update run."""
    root = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as patches:  # a module's fixture: no capfd to read
        fit(functools.partial(_esper_unread, monkeypatch=patches), root)
    return root / RUN0 / "checkpoints"


def _esper_unread(
    *args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``esper ARGS`` in this process, its output left to pytest's capture."""
    from esper.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["esper"])
    return subprocess.CompletedProcess(["esper", *args], main(list(args)), "")


# ------------------------------------------------------------------ safe checkpoints
@pytest.mark.slow
def test_every_checkpoint_fit_writes_loads_with_weights_only(trained: Path) -> None:
    files = sorted(trained.glob("*.ckpt"))
    assert {f.name for f in files} >= {"last.ckpt"}
    assert any(f.name.startswith("best-") for f in files), [f.name for f in files]
    for file in files:
        checkpoint = torch.load(file, weights_only=True)
        for key in ("state_dict", "esper_policy_spec", "esper_run_state", "hyper_parameters"):
            assert key in checkpoint, (file.name, key)


# ------------------------------------------------------------------ resume by path
@pytest.mark.slow
def test_resuming_from_a_copied_last_ckpt_by_path_ends_bit_identical(
    tmp_path: Path, here: Esper
) -> None:
    fit(here, tmp_path / "straight", max_epochs=3)
    # Interrupted after two updates of a three-update run: max_steps, not max_epochs, so
    # the run's schedules (learning-rate annealing) are those of the straight run.
    split = fit(
        here, tmp_path / "split", "--trainer.max_steps", str(2 * STEPS_PER_UPDATE), max_epochs=3
    )
    assert "esper fit: 2 PPO update(s)" in split.stdout
    elsewhere = tmp_path / "copied" / "somewhere.ckpt"
    elsewhere.parent.mkdir()
    shutil.copy(tmp_path / "split" / RUN0 / "checkpoints" / "last.ckpt", elsewhere)

    resumed = fit(here, tmp_path / "resumed", "--ckpt_path", str(elsewhere), max_epochs=3)

    assert "esper fit: 3 PPO update(s)" in resumed.stdout
    straight = policy_weights(tmp_path / "straight" / RUN0 / "checkpoints" / "last.ckpt")
    after = policy_weights(tmp_path / "resumed" / RUN0 / "checkpoints" / "last.ckpt")
    assert straight.keys() == after.keys()
    for name, value in straight.items():
        assert torch.equal(value, after[name]), name


@pytest.mark.slow
def test_a_best_checkpoint_resumes_by_path_in_its_run_folder(
    trained: Path, tmp_path: Path, here: Esper
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained.parents[2], run)  # resuming writes into the run it resumes
    best = next((run / RUN0 / "checkpoints").glob("best-*.ckpt"))
    resumed = fit(here, tmp_path / "elsewhere", "--ckpt_path", str(best), max_epochs=2)
    assert "esper fit: 2 PPO update(s)" in resumed.stdout
    assert not (tmp_path / "elsewhere").exists(), "the run continued in its own folder"
    last = torch.load(run / RUN0 / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["epoch"] == 1


# ------------------------------------------------------------------ bad checkpoint files
def _truncated(good: Path, path: Path) -> None:
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])


def _empty(good: Path, path: Path) -> None:
    path.write_bytes(b"")


def _not_a_checkpoint(good: Path, path: Path) -> None:
    path.write_text("these are notes, not a checkpoint\n")


def _no_state_dict(good: Path, path: Path) -> None:
    torch.save({"weights": torch.zeros(3)}, path)


def _code_on_load(good: Path, path: Path) -> None:
    # Loading this without weights_only would import and call pathlib: it must be refused.
    checkpoint = torch.load(good, weights_only=True)
    checkpoint["extra"] = Path("/anything")
    torch.save(checkpoint, path)


def _not_from_esper(good: Path, path: Path) -> None:
    checkpoint = torch.load(good, weights_only=True)
    del checkpoint["esper_policy_spec"]
    torch.save(checkpoint, path)


BAD_FILES = {
    "truncated": (_truncated, "truncated"),
    "empty": (_empty, "empty"),
    "not_a_checkpoint": (_not_a_checkpoint, "not a checkpoint"),
    "no_state_dict": (_no_state_dict, "no Lightning checkpoint"),
    "code_on_load": (_code_on_load, "safe load refuses"),
    "not_from_esper": (_not_from_esper, "not written by esper fit"),
}


def _assert_one_line_naming(
    result: subprocess.CompletedProcess[str], named: Path, says: str, before: set[Path], cwd: Path
) -> None:
    shown = lines(result)
    assert result.returncode != 0, result.stdout
    assert len(shown) == 1, result.stdout
    assert "Traceback" not in result.stdout
    assert named.name in shown[0] and says in shown[0], shown[0]
    assert set(cwd.rglob("*")) == before, "the failed run left files behind"


def _command(kind: str, path: Path, cwd: Path) -> list[str]:
    if kind == "fit":
        config = cwd / "tiny.yaml"
        config.write_text(TINY_CONFIG)
        return ["fit", "--config", str(config), "--ckpt_path", str(path)]
    return ["evaluate", "--ckpt", str(path), "--episodes", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fit", "evaluate"])
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_checkpoint_file_is_one_line_naming_it(
    trained: Path,
    tmp_path: Path,
    kind: str,
    case: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make, says = BAD_FILES[case]
    path = tmp_path / f"{case}.ckpt"
    make(trained / "last.ckpt", path)
    content = path.read_bytes()
    command = _command(kind, path, tmp_path)
    before = set(tmp_path.rglob("*"))

    result = esper_here(*command, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)

    _assert_one_line_naming(result, path, says, before, tmp_path)
    assert path.read_bytes() == content, "the checkpoint was modified"
    if kind == "evaluate":  # evaluate's words: it has --ckpt and resumes nothing
        assert "--ckpt_path" not in result.stdout and "resume" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fit", "evaluate"])
def test_a_missing_checkpoint_is_one_line_naming_it(
    tmp_path: Path,
    kind: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "gone" / "last.ckpt"
    command = _command(kind, path, tmp_path)
    before = set(tmp_path.rglob("*"))
    result = esper_here(*command, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    _assert_one_line_naming(result, path, "does not exist", before, tmp_path)
    flag = {"fit": "`--ckpt_path last`", "evaluate": "`--ckpt last`"}[kind]
    assert flag in result.stdout, result.stdout


@pytest.mark.parametrize("kind", ["fit", "evaluate"])
def test_last_with_no_run_to_resume_is_one_line_saying_where_it_looked(
    tmp_path: Path,
    kind: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if kind == "fit":
        command = ["fit", "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", "last"]
    else:
        command = ["evaluate", "--ckpt", "last"]
    before = set(tmp_path.rglob("*"))
    result = esper_here(*command, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    shown = lines(result)
    assert result.returncode == 2 and len(shown) == 1, result.stdout
    assert "no run under" in shown[0] and "last.ckpt" in shown[0], shown[0]
    assert set(tmp_path.rglob("*")) == before, "the refused run left files behind"


@pytest.mark.slow
def test_resuming_last_continues_the_newest_run_folder(
    trained: Path, tmp_path: Path, here: Esper
) -> None:
    root = tmp_path / "run"
    shutil.copytree(trained.parents[2], root)  # a finished 1-update run, version_0
    resumed = fit(here, root, "--ckpt_path", "last", max_epochs=2)
    assert "esper fit: 2 PPO update(s)" in resumed.stdout
    assert "exists and is not empty" not in resumed.stdout  # resuming there is the point
    assert [p.name for p in (root / "lightning_logs").iterdir()] == ["version_0"]
    run = root / RUN0
    # The end of the run says where it went and how to evaluate it.
    assert f"run folder: {run}" in resumed.stdout
    evaluate = f"esper evaluate --ckpt {run / 'checkpoints' / 'last.ckpt'}"
    assert f"last checkpoint: {run / 'checkpoints' / 'last.ckpt'}" in resumed.stdout
    assert evaluate in resumed.stdout, resumed.stdout
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1
    assert len(list(run.glob("events.out.tfevents.*"))) == 2, "one TensorBoard run, two files"


def _install_plugin_blueprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """One more blueprint registered and offered by the CNN host, as a plugin installed after
    the checkpoint was written would (both undone after the test): the action space changes."""
    from esper.kasmina import BLUEPRINTS
    from esper.kasmina.hosts.cnn import CNNHost

    BLUEPRINTS.names()  # entry-point plugins loaded into what the patch restores
    monkeypatch.setattr(BLUEPRINTS, "_entries", dict(BLUEPRINTS._entries))
    base = BLUEPRINTS.get("conv_light")
    BLUEPRINTS.register(PLUGIN_BLUEPRINT, dataclasses.replace(base, name=PLUGIN_BLUEPRINT))
    offered = (*CNNHost.default_blueprints, PLUGIN_BLUEPRINT)
    monkeypatch.setattr(CNNHost, "default_blueprints", offered)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fit", "evaluate"])
def test_a_checkpoint_from_another_action_space_is_one_line_naming_it(
    trained: Path, tmp_path: Path, kind: str, here: Esper, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "before_the_plugin.ckpt"
    shutil.copy(trained / "last.ckpt", path)
    command = _command(kind, path, tmp_path)
    before = set(tmp_path.rglob("*"))
    _install_plugin_blueprint(monkeypatch)

    result = here(*command, cwd=tmp_path)

    _assert_one_line_naming(result, path, "another action space", before, tmp_path)
    assert PLUGIN_BLUEPRINT in lines(result)[0]
    assert ("--ckpt_path" in lines(result)[0]) == (kind == "fit"), lines(result)[0]


# ------------------------------------------------------------------ bad data paths
@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "named", "says"),
    [
        (
            ["--data", "esper.tolaria.data.Cifar10DataModule", "--data.root", "{missing}"],
            "{missing}",
            "CIFAR-10 not found",
        ),
        (
            [
                "--data",
                "esper.tolaria.data.TokenSequenceDataModule",
                "--data.text_path",
                "{missing}/book.txt",
                "--data.val_fraction",
                "0.2",
                "--model.host",
                "transformer",
            ],
            "{missing}/book.txt",
            "does not exist",
        ),
    ],
    ids=["cifar_root", "text_path"],
)
def test_a_missing_data_path_is_one_line_naming_it(
    tmp_path: Path,
    args: list[str],
    named: str,
    says: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = str(tmp_path / "nowhere")
    before = set(tmp_path.rglob("*"))
    result = esper_here(
        "fit",
        *(a.format(missing=missing) for a in args),
        "--trainer.default_root_dir",
        str(tmp_path),
        cwd=tmp_path,
        capfd=capfd,
        monkeypatch=monkeypatch,
    )
    shown = lines(result)
    assert result.returncode != 0 and len(shown) == 1, result.stdout
    assert "Traceback" not in result.stdout
    assert named.format(missing=missing) in shown[0] and says in shown[0], shown[0]
    assert set(tmp_path.rglob("*")) == before, "the failed run left files behind"


def test_ctrl_c_exits_130_with_workers_joined_and_says_how_to_resume(
    tmp_path: Path, here: Esper
) -> None:
    import shlex
    import signal
    import time

    root = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(root)]
    # Two envs on two intra-op threads: host training runs in two worker threads on any
    # machine, which is where a Ctrl-C used to end in SIGABRT (workers left running).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "COLUMNS": "200",
        "OMP_NUM_THREADS": "2",
    }
    run = subprocess.Popen(
        [sys.executable, "-m", "esper.cli", *args, "--trainer.max_epochs", "50"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that starts jobs in the background (nohup, CI runners) hands them SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler: restore it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    last = root / RUN0 / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + TIMEOUT_S
    while not last.is_file() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert last.is_file(), "no update completed"
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=TIMEOUT_S)
    assert "terminate called" not in err, err[-2000:]
    assert run.returncode == INTERRUPTED_STATUS == 130, (run.returncode, err[-2000:])
    said = err[err.index("esper fit: interrupted") :]
    assert "last rollout:" in said and f"last checkpoint: {last}" in said, said
    resume = shlex.split(said.split("resume with:", 1)[1].strip().splitlines()[0])
    assert resume[:2] == ["esper", "fit"] and resume[-2:] == ["--ckpt_path", str(last)]
    # The run's own arguments as printed, stopped sooner than 50 updates (a later flag wins).
    finished = here(*resume[1:-2], "--trainer.max_epochs", "4", *resume[-2:], cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout
    assert "PPO update(s)" in finished.stdout


@pytest.mark.parametrize("how", ["path", "last"])
def test_resuming_a_finished_run_says_how_to_extend_it_and_creates_nothing(
    trained: Path, how: str, here: Esper
) -> None:
    root = trained.parents[2]  # <root>/lightning_logs/version_0/checkpoints
    before = sorted(p for p in root.parent.rglob("*"))
    ckpt = str(trained / "last.ckpt") if how == "path" else "last"
    result = try_fit(here, root, "--ckpt_path", ckpt, max_epochs=1)
    assert result.returncode == 2
    said = lines(result)
    assert len(said) == 1, said
    assert "already made its 1 PPO update(s)" in said[0] and "--trainer.max_epochs 2" in said[0]
    assert sorted(p for p in root.parent.rglob("*")) == before  # no new version folder


# ------------------------------------------------------------------ edited checkpoints
@pytest.mark.slow
def test_a_checkpoint_whose_weights_do_not_fit_its_settings_is_one_line_naming_them(
    trained: Path, tmp_path: Path, here: Esper
) -> None:
    path = tmp_path / "edited.ckpt"
    checkpoint = torch.load(trained / "last.ckpt", weights_only=True)
    del checkpoint["state_dict"]["policy.blueprint_head.bias"]
    torch.save(checkpoint, path)
    command = [*_command("fit", path, tmp_path), "--trainer.max_epochs", "2"]
    before = set(tmp_path.rglob("*"))

    result = here(*command, cwd=tmp_path)

    _assert_one_line_naming(result, path, "does not fit this run's model.policy", before, tmp_path)
    assert "blueprint_head.bias" in lines(result)[0]
