"""``esper --help`` as plain text: docstrings keep their Sphinx markup for the API docs, the
terminal gets the words.

jsonargparse builds option help and group titles from docstrings (ours and Lightning's), so
``:class:`PolicyNetwork``` and ````n_envs```` would otherwise reach the terminal raw.
"""

from __future__ import annotations

import re
from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

#: ``:role:`target``` or ``:role:`~pkg.target```: Sphinx cross-references.
_ROLE = re.compile(r":(?:py:)?[a-z]+:`~?(?:[\w.]*\.)?([^`<]+?)(?:\s*<[^>]*>)?`")
#: ````literal````: Sphinx inline literals.
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` with Sphinx roles and inline literals reduced to their words.

    A role keeps its last dotted name (``:class:`~esper.tamiyo.PolicyNetwork``` reads
    ``PolicyNetwork``); a literal keeps its content.
    """
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class PlainHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, with markup stripped from titles, texts and options."""

    def start_section(self, heading: str | None) -> None:
        super().start_section(plain(heading) if heading else heading)

    def add_text(self, text: str | None) -> None:
        super().add_text(plain(text) if text else text)

    def _expand_help(self, action: Any) -> str:
        return plain(super()._expand_help(action))


class EsperArgumentParser(LightningArgumentParser):
    """Lightning's parser with :class:`PlainHelpFormatter` as its default.

    A default rather than an argument, because jsonargparse builds the parser of a nested
    ``--model.ppo.help`` as ``type(parser)(description=...)``: only the class carries the
    formatter there.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        super().__init__(*args, **kwargs)
