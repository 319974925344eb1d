"""Config errors: the one error a bad configuration value raises, and the checks that raise it.

A config (``PPOConfig``, a data module, ...) names a bad value by its field (``clip_coef``)
and owns the error, so a Python caller reads ``PPOConfig.clip_coef: must be a finite
number > 0, got -1.0``. Whoever knows where that config sits in the run puts the error
under its place (:meth:`ConfigError.under`): ``esper fit`` prints
``model.ppo.clip_coef: must be ...``. Every message says which values are allowed.

What only the whole run can check (``model.n_envs`` across the ranks, the host against the
data) lives in ``esper.simic.validation``; ``esper.cli`` places and prints the error.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from esper.contracts.checks import is_finite_real


class ConfigError(ValueError):
    """A configuration value is wrong.

    Attributes:
        key: where the value is, relative to ``owner`` (``clip_coef``), or the full key
            when there is no owner (``model.ppo.clip_coef``).
        message: what is wrong and which values are allowed, without the key.
        owner: the class of the config that refused the value; None once placed.
    """

    def __init__(self, key: str, message: str, owner: type | None = None) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message
        self.owner = owner

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, type | None]]:
        # Rebuilt with its key and owner: DDP launchers may carry a rank's error to the parent.
        return type(self), (self.key, self.message, self.owner)

    def __str__(self) -> str:
        where = self.key if self.owner is None else f"{self.owner.__name__}.{self.key}"
        return f"{where}: {self.message}"

    def under(self, prefix: str) -> ConfigError:
        """This error at ``prefix.key``: ``prefix`` is where its config sits in the run."""
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.message)


@contextmanager
def owned_by(config: object) -> Iterator[None]:
    """Errors raised inside without an owner are ``config``'s: its class names them.

    The checks below name only the field; the config whose ``__post_init__`` (or
    ``__init__``) runs them wraps them in this, so the error says whose field it is.
    """
    try:
        yield
    except ConfigError as exc:
        if exc.owner is None:
            exc.owner = type(config)  # in place: the traceback still shows the failed check
        raise


def require_int(key: str, value: object, minimum: int, hint: str = "") -> int:
    """``value`` as an int >= ``minimum``; bools and floats are refused (``True`` or ``2.0``
    as a size is always a caller's mistake)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(key, f"must be an int >= {minimum}, got {value!r}{_then(hint)}")
    return int(value)


def require_number(
    key: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    null: str = "",
    hint: str = "",
) -> None:
    """``value`` is a finite real number within the given bounds.

    NaN and infinity would poison everything they touch, so they are always refused.
    ``null`` (what None means, e.g. ``"disable it"``) lets None through as well.
    """
    if value is None and null:
        return
    number = float(value) if is_finite_real(value) else None  # type: ignore[arg-type]
    if (
        number is None
        or (above is not None and number <= above)
        or (at_least is not None and number < at_least)
        or (below is not None and number >= below)
        or (at_most is not None and number > at_most)
    ):
        bounds = _bounds(above, at_least, below, at_most)
        or_null = f", or None (null) to {null};" if null else ","
        raise ConfigError(
            key, f"must be a finite number{bounds}{or_null} got {value!r}{_then(hint)}"
        )


def require_choice(key: str, value: object, allowed: Collection[object], what: str = "") -> None:
    """``value`` is one of ``allowed`` (``what`` names them, e.g. ``"registered hosts"``)."""
    if value not in allowed:
        among = f"the {what} " if what else ""
        raise ConfigError(key, f"must be one of {among}{list(allowed)}, got {value!r}")


def require_bool(key: str, value: object) -> bool:
    """``value`` is a bool: ``1`` or ``"yes"`` from a hand-written config is refused."""
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _bounds(
    above: float | None, at_least: float | None, below: float | None, at_most: float | None
) -> str:
    """`` > 0``, `` in [0, 1)``, ...: the allowed range as the message states it."""
    low = f"({above:g}" if above is not None else None if at_least is None else f"[{at_least:g}"
    high = f"{below:g})" if below is not None else None if at_most is None else f"{at_most:g}]"
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" {'>' if low[0] == '(' else '>='} {low[1:]}"
    if high:
        return f" {'<' if high[-1] == ')' else '<='} {high[:-1]}"
    return ""


def _then(hint: str) -> str:
    return f"; {hint}" if hint else ""
