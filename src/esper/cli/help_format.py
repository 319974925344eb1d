"""``esper --help`` as plain text: docstrings keep their Sphinx markup for the API docs, the
terminal gets the words.

jsonargparse builds option help and group titles from docstrings (ours and Lightning's), so
``:class:`PolicyNetwork``` and ````n_envs```` would otherwise reach the terminal raw.
"""

from __future__ import annotations

import re
import sys
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter
from jsonargparse._common import debug_mode_active
from lightning.pytorch.cli import LightningArgumentParser

#: Exit status of a command refused for a bad option (argparse's, and Esper's own).
BAD_INPUT_STATUS = 2
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
    """Lightning's parser with :class:`PlainHelpFormatter`, no abbreviated options and
    one-line errors as its defaults.

    Defaults rather than arguments, because jsonargparse builds the parser of a nested
    ``--model.ppo.help`` (and LightningCLI each subcommand's) as ``type(parser)(...)``:
    only the class carries them there. Abbreviations are refused because argparse would
    take ``--model.n_env 4`` as ``--model.n_envs 4`` and run a whole fit on a typo's guess.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """``PROG: error: KEY: ...`` in one line (``esper.cli.parse_errors``) and exit
        status 2, instead of the usage and a multi-line message. Where jsonargparse parses
        to try (``exit_on_error`` off) or debugs, its own behaviour stands."""
        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        from esper.cli.parse_errors import one_line
        from esper.tolaria.data import DATAMODULES

        parser = getattr(ex, "subcommand_parser", None) or self
        options = [o for action in parser._actions for o in action.option_strings]
        said = one_line(message, options, list(DATAMODULES.names()))
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {said}\n")
        self.exit(BAD_INPUT_STATUS)
