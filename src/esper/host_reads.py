"""Count every place a tensor's value is read on the host, so the hot path can be held to zero.

A host read (``.item()``, ``bool(t)``, ``nonzero()``, boolean-mask indexing, ...) makes the
CPU wait for the device to finish everything queued before it: on a GPU it stalls the
pipeline, and many small ones are what made the earlier system slow. Reviews miss them, so
tests run the rollout loop under :class:`HostReadCounter` and require a count of zero.

Two layers, because neither alone sees everything:

* a ``TorchDispatchMode`` sees the aten ops that need a value on the host
  (``_local_scalar_dense`` behind ``item``/``float``/``bool``/``int``, ``nonzero``,
  ``masked_select``, boolean ``index``, ``unique``, ``equal``, ``is_nonzero``, and copies
  from a device to the CPU such as ``.to("cpu")``), from Python and C++ alike;
* wrappers on ``Tensor.item/tolist/cpu/numpy/__bool__/__float__/__int__/__index__`` see the
  calls that never dispatch an aten op (``tolist``/``numpy`` read memory directly, and
  ``cpu()`` of a CPU tensor is a no-op) but are host reads on a GPU.

On a CPU-only machine every such call is counted, device or not: the CPU run is the proxy
for the GPU run, so a read that would sync on CUDA must show up here. Dispatch modes are
per thread: threads that run hot-path work enter :func:`counting_in_this_thread`.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten overload packets whose result depends on a tensor's value read on the host.
_READ_OPS: frozenset[str] = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::argwhere",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::equal",
        "aten::is_nonzero",
        "aten::allclose",
    }
)
#: Indexing is a host read only when an index is a boolean mask (it becomes ``nonzero``).
_INDEX_OPS: frozenset[str] = frozenset({"aten::index", "aten::index_put", "aten::index_put_"})

#: Copies are host reads when they bring device memory to the CPU (``.to("cpu")``, ``copy_``).
_COPY_OPS: frozenset[str] = frozenset({"aten::_to_copy", "aten::copy_"})

#: Tensor methods that read values on the host without necessarily dispatching an aten op.
WRAPPED_METHODS: tuple[str, ...] = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
)

#: Reads made by these packages are host-side bookkeeping on CPU tensors (the sampler's
#: ``randperm(...).tolist()``, the loader's base seed), never a device sync.
DEFAULT_IGNORED_PATHS: tuple[str, ...] = ("torch/utils/data/",)

#: How many caller frames a recorded read keeps, for the failure message.
_TRACE_DEPTH = 6


@dataclass(frozen=True)
class HostRead:
    """One counted read: what it was and where in user code it came from."""

    what: str
    where: str


class HostReadCounter(TorchDispatchMode):
    """Context manager counting host reads of tensor values made inside it.

    ``reads`` lists each one with a short stack, so a failing test says where to look.
    Reads made from frames under ``ignore_paths`` are not counted; pass ``()`` to count all.

    Counters nest, so a test can count around code that counts for itself (the telemetry's
    ``debug`` profile measures each rollout): each counts every read made while it is
    active, an inner counter's reads included. The method wrappers are process-global and
    the dispatch modes a stack, so counters end innermost first; exiting an outer counter
    first also ends those still active inside it (their own exit is then a no-op), so an
    exception unwinding past a counter left open elsewhere cannot leak its wrappers.
    """

    _active_lock = threading.Lock()
    #: Counters entered and not yet exited, outermost first.
    _active: ClassVar[list[HostReadCounter]] = []

    def __init__(self, ignore_paths: Iterable[str] = DEFAULT_IGNORED_PATHS) -> None:
        super().__init__()
        self.ignore_paths = tuple(p.replace("\\", "/") for p in ignore_paths)
        self.reads: list[HostRead] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._depth = threading.local()

    # ----------------------------------------------------------------- results
    @property
    def count(self) -> int:
        return len(self.reads)

    def report(self) -> str:
        """A readable list of the reads, for assertion messages."""
        if not self.reads:
            return "no host reads"
        lines = [f"{self.count} host read(s):"]
        for read in self.reads:
            lines.append(f"- {read.what}\n{read.where}")
        return "\n".join(lines)

    # --------------------------------------------------------------- recording
    def _inside(self) -> bool:
        return getattr(self._depth, "value", 0) > 0

    def _record(self, what: str) -> None:
        frames = _user_frames(sys._getframe(2))
        if any(self._ignored(f) for f in frames):
            return
        where = "".join(traceback.format_list(traceback.extract_stack(frames[0])[-_TRACE_DEPTH:]))
        self.reads.append(HostRead(what, where))

    def _ignored(self, frame: FrameType) -> bool:
        filename = frame.f_code.co_filename.replace("\\", "/")
        return any(path in filename for path in self.ignore_paths)

    # --------------------------------------------------------- dispatch layer
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        if not self._inside() and (
            name in _READ_OPS
            or (name in _INDEX_OPS and _has_bool_index(args))
            or (name in _COPY_OPS and _copies_to_host(name, args, kwargs))
        ):
            self._record(f"aten op {func}")
        return func(*args, **kwargs)

    # ----------------------------------------------------------- method layer
    def _wrap(self, method: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, method)
        counter = self

        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._inside():
                return original(tensor, *args, **kwargs)
            counter._record(f"Tensor.{method}")
            counter._depth.value = 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._depth.value = 0

        wrapper.__name__ = method
        self._originals[method] = original
        return wrapper

    def __enter__(self) -> HostReadCounter:
        with HostReadCounter._active_lock:
            if any(c is self for c in HostReadCounter._active):
                raise RuntimeError("this HostReadCounter is already active; use a new one")
            HostReadCounter._active.append(self)
        # Wrapping what is there now chains onto an outer counter's wrappers.
        for method in WRAPPED_METHODS:
            setattr(torch.Tensor, method, self._wrap(method))
        try:
            return super().__enter__()
        except BaseException:
            self._restore_methods()
            with HostReadCounter._active_lock:
                HostReadCounter._active.remove(self)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with HostReadCounter._active_lock:
            if not any(c is self for c in HostReadCounter._active):
                return  # already ended by an outer counter's exit
            while HostReadCounter._active[-1] is not self:
                HostReadCounter._active.pop()._end(exc_type, exc, tb)
            HostReadCounter._active.pop()
        self._end(exc_type, exc, tb)

    def _end(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Pop this counter's dispatch mode and put back the methods it wrapped."""
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._restore_methods()

    def _restore_methods(self) -> None:
        for method, original in self._originals.items():
            setattr(torch.Tensor, method, original)
        self._originals.clear()


class _ThreadMode(TorchDispatchMode):
    """A counter's dispatch layer in one more thread (see :func:`counting_in_this_thread`)."""

    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self._counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return self._counter.__torch_dispatch__(func, types, args, kwargs)


@contextmanager
def counting_in_this_thread() -> Iterator[None]:
    """Extend every active :class:`HostReadCounter` to the calling thread for the block.

    Torch keeps dispatch modes per thread, so a counter entered on the main thread does
    not see the aten reads (a boolean-mask index, ``nonzero``) made in a worker thread;
    its method wrappers are process-wide and see the rest. Code that runs hot-path work
    in threads of its own (``esper.tolaria.parallel``'s host workers) wraps each thread's
    work in this, so the rollout's zero-read tests cover it. Nothing happens where no
    counter is active.
    """
    with HostReadCounter._active_lock:
        active = list(HostReadCounter._active)
    with ExitStack() as stack:
        for counter in active:  # outermost first, as they nest on the main thread
            stack.enter_context(_ThreadMode(counter))
        yield


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    """True when an ``index``/``index_put`` call carries a bool/uint8 mask among its indices."""
    if len(args) < 2:
        return False
    indices = args[1]
    if not isinstance(indices, (list, tuple)):
        return False
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _copies_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for a device-to-CPU copy; CPU-to-CPU and host-to-device copies are not reads."""
    if name == "aten::_to_copy":
        source, target = args[0], kwargs.get("device")
        return (
            isinstance(source, torch.Tensor)
            and source.device.type != "cpu"
            and target is not None
            and torch.device(target).type == "cpu"
        )
    if len(args) < 2:
        return False
    target, source = args[0], args[1]
    return (
        isinstance(target, torch.Tensor)
        and isinstance(source, torch.Tensor)
        and target.device.type == "cpu"
        and source.device.type != "cpu"
    )


def _user_frames(frame: FrameType | None) -> list[FrameType]:
    """The caller's frames, innermost first, skipping this module and torch's dispatch glue."""
    frames: list[FrameType] = []
    here = __file__
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != here and "torch/utils/_python_dispatch" not in filename.replace("\\", "/"):
            frames.append(frame)
        frame = frame.f_back
    return frames
