"""``copy.deepcopy`` of hosts and optimizers, its Python part made by pickle.

Why: the governor snapshots every env at each episode's start and every few epochs
(``esper.tolaria.snapshot``), and a stacked group whose members run different seeds builds
a template host each epoch (``esper.tolaria.stacked``). Their tensors are copied in a few
multi-tensor copies and handed over in the memo, so what is left is the Python objects
around them, and ``copy.deepcopy`` walks those in Python: 2.7 ms for one grown host of
the side-by-side work with its optimizers on the 2-core VM, about 35 times an update at 16
envs. Pickle walks the same objects in C: a dump and a load take about a third of that.

:func:`deepcopy_structure` is ``copy.deepcopy(objects, memo)`` for the memos those callers
pass: each tensor in ``memo`` (by ``id``) is replaced by its entry, and any other tensor
is ``copy.deepcopy``-ed with that memo (views of one storage stay views of one copy).
Everything else is pickled and unpickled in one pass, so objects shared within
``objects`` (a parameter held by a module and by its optimizer) stay shared in the copy.

Objects that do not pickle (a lambda or a class defined in a function, a lock, a weak
reference) make the whole copy fall back to ``copy.deepcopy``, which copies those by
reference or raises as it always did. Pickle and deepcopy copy alike otherwise: both
rebuild an object through ``__reduce_ex__`` and its ``__setstate__``, and both keep enum
members, classes and functions as they are; an object with its own ``__deepcopy__``
would lose it here, and none in a host or an optimizer has one but the tensors, which
never reach pickle.
"""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
import threading
from collections import OrderedDict
from typing import Any, TypeVar

from torch import Tensor, nn

T = TypeVar("T")

#: Where an unpickling thread finds the tensors its pickle refers to by position.
_loading = threading.local()


def deepcopy_structure(objects: T, memo: dict[int, Any]) -> T:
    """``copy.deepcopy(objects, memo)``, made by one pickle dump and load (see the module's
    docstring); ``memo`` maps ``id(tensor)`` to that tensor's copy and gains the tensors
    copied here."""
    tensors: list[Tensor] = []
    try:
        data = _dump(objects, memo, tensors)
    except (pickle.PicklingError, TypeError, AttributeError):
        return copy.deepcopy(objects, memo)
    _loading.tensors = tensors
    try:
        return pickle.loads(data)
    finally:
        del _loading.tensors


def _dump(objects: Any, memo: dict[int, Any], tensors: list[Tensor]) -> bytes:
    """``objects`` pickled, each tensor written as its position in ``tensors``, which gets
    its copy: ``memo``'s, or a ``copy.deepcopy`` with ``memo``."""

    def by_position(tensor: Tensor) -> tuple[Any, tuple[int]]:
        fresh = memo.get(id(tensor))
        if fresh is None:
            fresh = copy.deepcopy(tensor, memo)
        tensors.append(fresh)
        return _tensor_at, (len(tensors) - 1,)

    sink = io.BytesIO()
    pickler = pickle.Pickler(sink, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _Reducers(by_position)
    pickler.dump(objects)
    return sink.getvalue()


class _Reducers(dict):
    """A pickler's ``dispatch_table`` (reducers by exact type) that sends every tensor,
    of any tensor type, to ``by_position``, and every other type where pickle would:
    ``copyreg``'s table, else the object's own ``__reduce_ex__``.

    Why every tensor type: pickle's own reduction of a tensor serialises its storage,
    which for a GPU tensor is a copy to the host that waits for the device. Pickle asks
    this table only for types it has no built-in case for (not ints, strings, lists or
    dicts), so a copy asks it about a few hundred objects."""

    def __init__(self, by_position: Any) -> None:
        super().__init__(
            {Tensor: by_position, nn.Parameter: by_position, OrderedDict: _ordered_dict}
        )
        self._by_position = by_position
        self._others: set[type] = set()

    def __missing__(self, kind: type) -> Any:
        if kind not in self._others:
            if issubclass(kind, Tensor):
                self[kind] = self._by_position
                return self._by_position
            self._others.add(kind)
        reducer = copyreg.dispatch_table.get(kind)
        if reducer is None:
            raise KeyError(kind)
        return reducer


def _ordered_dict(mapping: OrderedDict) -> tuple[Any, ...]:
    """What ``OrderedDict.__reduce__`` gives, without its lookup of ``copyreg._slotnames``:
    a module holds a dozen (its parameters, buffers, submodules and hooks), so a host's
    copy meets a few hundred."""
    return OrderedDict, (), vars(mapping) or None, None, iter(mapping.items())


def _tensor_at(position: int) -> Tensor:
    """The copy of the tensor a pickle wrote at ``position`` (see :func:`_dump`)."""
    return _loading.tensors[position]
