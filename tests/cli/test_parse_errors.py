"""``esper fit``'s command-line mistakes end in one line naming the key, the value and
what would be accepted, with exit status 2; abbreviated options are refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from esper.cli.parse_errors import did_you_mean, one_line
from tests.test_cli_checkpoints import esper_here, lines

#: jsonargparse's messages, as it raised them (jsonargparse 4.53).
NESTED = (
    'Parser key "model.ppo":\n  Does not validate against any of the Union subtypes\n'
    "  Subtypes: [<class 'esper.simic.ppo.PPOConfig'>, <class 'NoneType'>]\n  Errors:\n"
    "    - Problem with given class_path 'esper.simic.ppo.PPOConfig':\n"
    "        Parser key \"clip_coef\":\n          Expected a <class 'float'>. Got value: abc\n"
    "    - Expected a <class 'NoneType'>\n"
    "  Given value type: <class 'jsonargparse._util.NestedArg'>\n"
    "  Given value: NestedArg(key='clip_coef', val='abc')"
)
OPTIONS = ["--model.n_envs", "--model.host", "--model.episode_epochs", "--model.devices"]
DATA = ["digits", "cifar10", "synthetic", "tokens"]


def test_a_nested_key_is_named_in_full_with_the_type_it_expects_and_the_value() -> None:
    assert one_line(NESTED, OPTIONS, DATA) == "model.ppo.clip_coef: expected a number, got 'abc'"


def test_an_optional_value_says_null_is_accepted_too() -> None:
    message = (
        "Parser key \"trainer.max_epochs\":\n  - Expected a <class 'int'>. Got value: x\n"
        "  - Expected a <class 'NoneType'>. Got value: x"
    )
    assert one_line(message, OPTIONS, DATA) == (
        "trainer.max_epochs: expected an integer or null, got 'x'"
    )


def test_a_message_on_the_key_line_is_kept() -> None:
    message = "Parser key \"config\": File does not exist: '/tmp/x.yaml'"
    assert one_line(message, OPTIONS, DATA) == "config: file does not exist: '/tmp/x.yaml'"


def test_an_unknown_option_suggests_only_close_names() -> None:
    said = one_line("unrecognized arguments: --model.n_envz 4", OPTIONS, DATA)
    assert said.startswith("unknown option --model.n_envz (did you mean --model.n_envs?)")
    far = one_line("unrecognized arguments: --zzz 4", OPTIONS, DATA)
    assert "did you mean" not in far and "esper fit --help" in far


def test_a_stray_word_is_named() -> None:
    assert "'extra'" in one_line("unrecognized arguments: extra", OPTIONS, DATA)


def test_suggestions_are_empty_where_nothing_is_close() -> None:
    assert did_you_mean("nosuchdata", DATA) == ""
    assert did_you_mean("digit", DATA) == " (did you mean digits?)"


def esper_fit(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], mp: pytest.MonkeyPatch, *args: str
):
    return esper_here("fit", *args, cwd=tmp_path, capfd=capfd, monkeypatch=mp)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--model.episode_epochs", "abc"], "model.episode_epochs: expected an integer, got 'abc'"),
        (["--model.n_envz", "4"], "unknown option --model.n_envz (did you mean --model.n_envs?)"),
        (["--model.n_env", "4"], "unknown option --model.n_env (did you mean --model.n_envs?)"),
        (["--data", "nosuchdata"], "data: 'nosuchdata' is not a data module; choose from digits"),
        (["--data", "digit"], "data: 'digit' is not a data module (did you mean digits?)"),
        (["--model.ppo.clip_coef", "abc"], "model.ppo.clip_coef: expected a number, got 'abc'"),
    ],
)
def test_a_bad_option_is_one_line_naming_key_value_and_choices(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    says: str,
) -> None:
    result: subprocess.CompletedProcess[str] = esper_fit(tmp_path, capfd, monkeypatch, *args)
    shown = lines(result)
    assert result.returncode == 2 and len(shown) == 1, result.stdout
    assert shown[0].startswith("esper fit: error: ") and says in shown[0], shown[0]
    assert list(tmp_path.iterdir()) == [], "a refused run left files behind"


def test_every_data_name_is_offered_when_data_names_none(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from esper.tolaria.data import DATAMODULES

    shown = lines(esper_fit(tmp_path, capfd, monkeypatch, "--data", "nosuchdata"))
    assert all(name in shown[0] for name in DATAMODULES.names()), shown[0]
