"""Sizing a plain host to a parameter count: the ``static_equal`` control.

``esper evaluate`` sets a grown network against a plain network of the same host family
with as many parameters as the learned grower's final networks on average. Whether
growth helps is then a question of *where* the parameters went, not how many there are.

The family widens itself (:meth:`HostModel.widened_kwargs`); this module searches the
widening factor. Each candidate is built and its parameters counted (a measured count,
not a formula: a host may add norms, biases or slot parameters a formula forgets), with
torch's random generator left where it was.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn

from esper.contracts.checks import is_finite_real
from esper.kasmina.hosts.base import HostModel

#: How close a widened host's count must be to the target by default, relative.
DEFAULT_TOLERANCE = 0.05
#: The widest search: a target that needs wider stages than this is refused. Candidates
#: are real CPU modules, and 64 times the widths is already some 4 000 times the
#: parameters of a conv or attention host, far beyond what seeds add to one.
MAX_WIDENING = 64.0
#: The search first doubles the factor until the count passes the target, then bisects
#: (in log space) until the bracket is this narrow ...
BRACKET_RATIO = 1.05
#: ... and then tries every factor of a geometric grid of this ratio over the bracket,
#: widened by one grid step each way (a floor rounding just past the bracket can land
#: nearest). One percent of width is about two of parameters: far finer than the 5%.
GRID_RATIO = 1.01


def count_parameters(model: nn.Module) -> int:
    """All parameters of ``model``, whatever optimizer owns them."""
    return sum(p.numel() for p in model.parameters())


def _build_and_count(
    host_cls: type[HostModel],
    input_shape: tuple[int, ...],
    n_classes: int,
    kwargs: Mapping[str, Any],
) -> int:
    """The parameter count of ``host_cls`` built on the CPU with ``kwargs``.

    The initialisers' random draws are undone (``fork_rng``), so sizing a control does
    not shift the random numbers of whatever is built after it. Why not the ``meta``
    device, which skips the initialisers' work: its first ``normal_`` (every embedding)
    imports some 800 modules (dynamo, sympy), about 0.9 s on this project's VM, more than
    the whole search costs on the CPU (0.05 s for the default hosts, 0.35 s for a
    Transformer twenty times the default size).
    """
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        return count_parameters(host_cls.from_data(input_shape, n_classes, **kwargs))


def _key(value: Any) -> Hashable:
    """A hashable stand-in for a kwargs value, so equal candidates are counted once."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _key(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_key(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class _Search:
    """The candidates measured so far, each once, keyed by their arguments."""

    def __init__(
        self,
        host_cls: type[HostModel],
        base_kwargs: Mapping[str, Any],
        input_shape: tuple[int, ...],
        n_classes: int,
    ) -> None:
        self.host_cls = host_cls
        self.base_kwargs = dict(base_kwargs)
        self.input_shape = input_shape
        self.n_classes = n_classes
        self.measured: dict[Hashable, tuple[dict[str, Any], int]] = {}

    def largest_at(self, factor: float) -> int:
        """Measure every candidate of ``factor``; the largest count among them."""
        counts = []
        for kwargs in self.host_cls.widened_kwargs(self.base_kwargs, factor):
            key = _key(kwargs)
            if key not in self.measured:
                count = _build_and_count(self.host_cls, self.input_shape, self.n_classes, kwargs)
                self.measured[key] = (kwargs, count)
            counts.append(self.measured[key][1])
        return max(counts)

    def closest(self, target: float) -> tuple[dict[str, Any], int]:
        return min(self.measured.values(), key=lambda item: abs(item[1] - target))


def equal_size_host_kwargs(
    host_cls: type[HostModel],
    base_kwargs: Mapping[str, Any],
    input_shape: tuple[int, ...],
    n_classes: int,
    target_params: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[dict[str, Any], int]:
    """Constructor arguments of ``host_cls`` widened to about ``target_params`` parameters.

    Returns the candidate (from :meth:`HostModel.widened_kwargs`) whose measured count
    is closest to the target, and that count: ``host_cls.from_data(input_shape,
    n_classes, **kwargs)`` has exactly that many parameters. The search doubles the
    widening factor until the count passes the target, bisects to a narrow bracket and
    tries a fine geometric grid over it, so it builds a few dozen candidates whatever
    the target (the count grows with the factor: wider never means fewer parameters).

    Raises:
        ValueError: the target is not a positive number, the tolerance is not in (0, 1),
            or no candidate lands within ``tolerance`` (relative) of the target: below
            the unwidened host's own count (widening cannot shrink a host), beyond
            :data:`MAX_WIDENING`, or between the family's steps.
        NotImplementedError: ``host_cls`` does not implement ``widened_kwargs``.
    """
    if not (is_finite_real(target_params) and target_params > 0):
        raise ValueError(f"target_params must be a finite number > 0, got {target_params!r}")
    if not (is_finite_real(tolerance) and 0 < tolerance < 1):
        raise ValueError(f"tolerance must be a relative error in (0, 1), got {tolerance!r}")
    target_params = float(target_params)
    name = host_cls.__name__
    search = _Search(host_cls, base_kwargs, tuple(input_shape), n_classes)
    base_count = _build_and_count(host_cls, tuple(input_shape), n_classes, base_kwargs)

    def within(count: int) -> bool:
        return abs(count - target_params) <= tolerance * target_params

    if target_params < base_count and not within(base_count):
        raise ValueError(
            f"cannot size {name} to {target_params:,.0f} parameters: the unwidened host "
            f"({dict(base_kwargs)}) already has {base_count:,}, more than {tolerance:.0%} "
            "above the target, and static_equal widens a host, it cannot shrink one; "
            "start from a narrower host configuration"
        )

    low, high = 1.0, 1.0
    while search.largest_at(high) < target_params:
        if high >= MAX_WIDENING:
            kwargs, count = search.closest(target_params)
            raise ValueError(
                f"cannot size {name} to {target_params:,.0f} parameters: widening it "
                f"{MAX_WIDENING:g} times reached only {count:,} ({kwargs}); "
                "start from a wider host configuration"
            )
        low, high = high, min(2 * high, MAX_WIDENING)
    while high / low > BRACKET_RATIO:
        middle = math.sqrt(low * high)
        if search.largest_at(middle) < target_params:
            low = middle
        else:
            high = middle
    factor = max(1.0, low / GRID_RATIO)
    while factor <= high * GRID_RATIO:
        search.largest_at(factor)
        factor *= GRID_RATIO

    kwargs, count = search.closest(target_params)
    if not within(count):
        raise ValueError(
            f"cannot size {name} to {target_params:,.0f} parameters within {tolerance:.0%}: "
            f"the closest widening of {dict(base_kwargs)} has {count:,} ({kwargs}), "
            f"{abs(count - target_params) / target_params:.1%} off; the family's widths "
            "move in steps too coarse at this size (widen a host with more stages or "
            "layers, or allow a larger tolerance)"
        )
    return kwargs, count
