"""Every ``esper`` command in README.md runs as written (with a tiny budget added).

The commands are read from the README itself, so an example that breaks fails here. They
run in order, as subprocesses, in one scratch folder with ``HOME`` pointing at it (the
CIFAR-10 example reads ``~/data/...``: a tiny fake release is written there), so
``esper evaluate --ckpt last`` finds what the ``esper fit`` before it
wrote. The budget flags come after the README's own, so they win.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tolaria.data.test_cifar10 import make_fake_cifar

README = Path(__file__).resolve().parents[1] / "README.md"
#: Added to every ``esper fit``: one update of 2-epoch episodes over 2 envs.
FIT_BUDGET = [
    "--trainer.max_epochs",
    "1",
    "--model.episode_epochs",
    "2",
    "--model.n_envs",
    "2",
    "--model.ppo.n_minibatches",
    "1",
    "--data.batch_size",
    "64",
]
#: Added to every ``esper evaluate``.
EVALUATE_BUDGET = ["--episodes", "2"]
#: What each command must print (on stdout) besides exiting 0.
EXPECTED = {
    "fit": "host val accuracy",
    "evaluate": "− no growth (mean ± SE)",
    "report": "learning_curve.png",
    "plugins": "esper.blueprints",
}
#: Third-party notices a normal run must not print.
NOISE = ("litlogger", "is deprecated")
#: Subcommands that run with no arguments: an inline ``esper evaluate`` is a name in
#: prose, an inline ``esper plugins`` is a command.
NEEDS_NO_ARGUMENTS = frozenset({"fit", "plugins"})
#: Words that stand for something the reader fills in: such a span is not a command.
PLACEHOLDER = re.compile(r"\.\.\.|\b[A-Z]{3,}\b")


def readme_commands(text: str) -> list[str]:
    """``esper ...`` commands of the README: in ``bash`` blocks (continuation lines joined,
    ``&&`` chains split, comments dropped) and in inline code spans."""
    commands: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            part: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word != "&&":
                    part.append(word)
                    continue
                if part[:1] == ["esper"]:
                    commands.append(shlex.join(part))
                part = []
    for span in re.findall(r"`(esper [^`]+)`", text):
        span = " ".join(span.split())  # a span wrapped across lines is the same command
        words = span.split()
        runnable = len(words) > 2 or words[1] in NEEDS_NO_ARGUMENTS
        if runnable and not PLACEHOLDER.search(span):
            commands.append(span)
    return list(dict.fromkeys(commands))  # in order, each once


COMMANDS = readme_commands(README.read_text())


def test_the_readme_has_the_commands_a_newcomer_runs() -> None:
    subcommands = {shlex.split(c)[1] for c in COMMANDS}
    assert {"fit", "evaluate", "report", "plugins"} <= subcommands, COMMANDS
    assert "esper fit" in COMMANDS  # the quick start's own run


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("readme")
    make_fake_cifar(home / "data")
    return home


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command: str, scratch: Path) -> None:
    words = shlex.split(command)
    if "gpu" in words and not torch.cuda.is_available():
        pytest.skip("the command asks for a GPU and this machine has none")
    words = [str(scratch / w[2:]) if w.startswith("~/") else w for w in words]  # as a shell would
    subcommand = words[1]
    if subcommand == "fit" and "--help" not in words and "--print_config" not in words:
        words += FIT_BUDGET
    if subcommand == "evaluate":
        words += EVALUATE_BUDGET
    env = {
        **os.environ,
        "HOME": str(scratch),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [sys.executable, "-m", "esper", *words[1:]],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    # A subcommand the README runs must say here what it prints: no command passes unread.
    expected = "usage: esper" if "--help" in words else EXPECTED[subcommand]
    assert expected in done.stdout, f"{command}: {expected!r} not printed\n{done.stdout[-2000:]}"
    printed = done.stdout + done.stderr
    for noise in NOISE:  # a normal run carries no third-party adverts or deprecations
        assert noise not in printed, f"{command} printed {noise!r}:\n{printed[-3000:]}"


def test_every_file_the_layout_names_exists() -> None:
    """The "one file per concept" table is where a newcomer starts reading: a file that
    moved away leaves them at a dead end."""
    text = README.read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.index("\n## ", 1)]
    named = re.findall(r"`(src/esper/[^`]+)`", layout)
    assert len(named) >= 10, named
    root = README.parent
    for path in named:
        assert (root / path).exists(), f"README's layout names {path}, which does not exist"
    relative = re.findall(r"`((?:simic|tolaria|kasmina|callbacks)/[^`]+\.py)`", layout)
    for path in relative:
        assert (root / "src" / "esper" / path).exists(), f"README's layout names {path}"


def test_a_command_wrapped_across_lines_is_read_once() -> None:
    """Markdown wraps long inline code; the wrapped span is the same command, not another
    one to run (it was run twice, 12 s of the suite)."""
    text = "Run `esper evaluate --ckpt last --episodes 4` or, wrapped, `esper evaluate\n--ckpt last --episodes 4`."
    assert readme_commands(text) == ["esper evaluate --ckpt last --episodes 4"]
