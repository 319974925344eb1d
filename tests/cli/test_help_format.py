"""``esper --help`` reads as plain text: no Sphinx roles or inline literals reach it."""

from __future__ import annotations

import re

import pytest

from esper.cli import main
from esper.cli.help_format import plain

#: What Sphinx markup looks like once printed: ``literal`` or :role:`target`.
_MARKUP = re.compile(r"``|:[a-z]+:`")


@pytest.mark.parametrize(
    ("marked", "read"),
    [
        ("over ``n_envs`` hosts", "over n_envs hosts"),
        ("a :class:`PolicyNetwork`", "a PolicyNetwork"),
        ("a :class:`~esper.tamiyo.PolicyNetwork`", "a PolicyNetwork"),
        (":data:`DEFAULT_HOST_KWARGS` for that host", "DEFAULT_HOST_KWARGS for that host"),
        (":meth:`PolicyNetwork.act <esper.tamiyo.PolicyNetwork.act>`", "act"),
        ("no markup: a `single` tick stays", "no markup: a `single` tick stays"),
    ],
)
def test_plain_keeps_the_words_of_roles_and_literals(marked: str, read: str) -> None:
    assert plain(marked) == read


def _help_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["fit", *args])
    assert exited.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [["--help"], ["--model.ppo.help"], ["--model.lifecycle.help"], ["--data.help", "tokens"]],
    ids=lambda args: " ".join(args),
)
def test_fit_help_shows_no_sphinx_markup(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = _help_of(args, capsys)
    assert "--" in shown  # it printed the options
    assert not _MARKUP.search(shown), _MARKUP.search(shown)


def test_group_titles_are_whole_sentences(capsys: pytest.CaptureFixture[str]) -> None:
    """A title is a class docstring's first line: one that breaks mid-sentence ends in a
    word like "and:" instead of a thought."""
    shown = _help_of(["--model.ppo.help"], capsys)
    title = next(line for line in shown.splitlines() if line.startswith("PPO hyper-parameters"))
    assert not re.search(r"\b(and|or|except|the|of|for):$", title), title
