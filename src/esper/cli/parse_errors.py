"""``esper fit``'s command-line errors in one line, as Esper's own errors are.

jsonargparse answers a bad option with the whole usage (60-70 lines) and then a message
that spreads over several lines and speaks of Python types ("Parser key "data": ... Does
not validate against any of the Union subtypes ..."). What the user needs is the key, the
value they gave and what would have been accepted: this module reads those out of
jsonargparse's message and says them in one line, with a "did you mean" where a close
name exists.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

#: How close a name must be to the one typed to be suggested (difflib's ratio).
SUGGEST_CUTOFF = 0.8
#: Suggestions named at most.
MAX_SUGGESTIONS = 3

_KEY = re.compile(r'Parser key "([^"]+)"')
_VALUE = re.compile(r"(?:Got|Given) value: (.*)")
_EXPECTED = re.compile(r"Expected an? (.+?)(?:\. Got value|$)")
_CLASS = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_UNRECOGNIZED = re.compile(r"[Uu]nrecognized arguments: (.*)")
_PLAIN_TYPES = {"NoneType": "null", "str": "a string", "int": "an integer", "float": "a number"}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean X?)"`` (or ``X or Y``) for the choices close to ``word``; ``""``
    where none is."""
    close = difflib.get_close_matches(word, list(choices), MAX_SUGGESTIONS, SUGGEST_CUTOFF)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def one_line(message: str, options: Sequence[str], data_names: Sequence[str]) -> str:
    """jsonargparse's error ``message`` as one line naming the key, the value and what is
    accepted.

    ``options`` are the parser's option strings (``--model.n_envs`` ...), offered where an
    option is unknown; ``data_names`` the data registry's names, offered where ``--data``
    names no data module. A key inside a nested config (``model.ppo`` holding
    ``clip_coef``) is named in full. A message of another shape keeps its first line.
    """
    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        return _unknown_option(unknown.group(1).split(), options)
    keys = list(_KEY.finditer(message))
    if not keys:
        return _squeeze(message.strip().splitlines()[0]) if message.strip() else message
    outer, inner = keys[0], keys[-1]
    name = outer.group(1) if inner is outer else f"{outer.group(1)}.{inner.group(1)}"
    innermost = _block(message, inner)
    value = _VALUE.search(innermost)
    given = value.group(1).strip() if value else None
    if name == "data":
        return _bad_data(given, data_names)
    same_line = innermost.split("\n", 1)[0].lstrip(":").strip()
    if same_line:
        return f"{name}: {same_line[0].lower()}{same_line[1:]}"
    expected = _expected(innermost)
    said = f"{name}: expected {expected}" if expected else f"{name}: invalid value"
    return f"{said}, got {given!r}" if given is not None else said


def _unknown_option(words: list[str], options: Sequence[str]) -> str:
    flags = [w for w in words if w.startswith("-")]
    if not flags:
        return f"unexpected argument {words[0]!r} (options start with --)" if words else ""
    flag = flags[0].split("=", 1)[0]
    hint = did_you_mean(flag, options) or " (`esper fit --help` lists the options)"
    return f"unknown option {flag}{hint}; options are never abbreviated"


def _bad_data(given: str | None, data_names: Sequence[str]) -> str:
    names = ", ".join(data_names)
    hint = did_you_mean(given or "", data_names)
    return (
        f"data: {given!r} is not a data module{hint}; choose from {names} "
        "or give a HostDataModule's class path"
    )


def _expected(message: str) -> str:
    """What jsonargparse said it expected, as plain words: ``an integer or null``."""
    kinds: list[str] = []
    for line in message.splitlines():
        found = _EXPECTED.search(line.strip())
        if not found:
            continue
        text = found.group(1).strip()
        cls = _CLASS.search(text)
        kind = _PLAIN_TYPES.get(cls.group(1), cls.group(1)) if cls else text
        if kind not in kinds:
            kinds.append(kind)
    return " or ".join(kinds)


def _block(message: str, key: re.Match[str]) -> str:
    """The text that belongs to ``key``: the rest of its line and the lines below it
    indented deeper (a nested key is followed by its outer key's other alternatives)."""
    line_start = message.rfind("\n", 0, key.start()) + 1
    indent = len(message[line_start:]) - len(message[line_start:].lstrip())
    rest = message[key.end() :].split("\n")
    kept = [rest[0]]
    for line in rest[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        kept.append(line)
    return "\n".join(kept)


def _squeeze(text: str) -> str:
    return " ".join(text.split())
