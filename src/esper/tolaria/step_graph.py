"""A host training step recorded once an epoch and replayed: CUDA graphs.

Why: on a GPU a stacked step of small hosts is a few hundred kernels of microseconds,
and issuing them from Python (vmap's batching rules, autograd, the dispatcher) is the
step's wall: 0.55 ms a host step at 16 envs of the predecessor's host on an H100, about
60 operators at roughly 100 us of host time each (benchmarks/README.md, issue 35). A CUDA
graph records the kernels of one step and replays them with one launch, so the host's
side of a step becomes a copy of the batch and a replay. Two kinds of step record: a
stacked group's (``esper.tolaria.stacked``) and an env's own (``esper.tolaria.epoch``: the
per-env engine's, and an env a stacked epoch leaves alone, whose eager steps would
otherwise cost, once the group's replay, more than the group).

What a replay repeats is device work only, on the same memory. So the recorded step must
read its batch from tensors that stay put (:class:`GraphedStep` copies each batch into
them), must not read a device tensor on the host (the hot path's rule everywhere), and
leaves its Python bookkeeping (samples seen, the last batch) to its caller, who does it at
every call. Tensors the recorded step allocates (gradients, activations) live in the
graph's memory pool for as long as the graph does.

When: a group's tensors are stacked afresh each epoch, and an env's accumulators live one
epoch, so a graph lives one epoch. Of each layout of the batch (shapes, strides, dtypes),
the first call runs as it is (an env's step makes momentum buffers for a seed's first
step); the next is recorded, then replayed, and every later call of that layout is
replayed. A step that makes nothing at its first call (a stacked group's: its stacking
makes every buffer the step needs) says what its kernels' shapes depend on (``shapes``),
and is recorded at its first call where a step of the same ``shapes`` and layout ran as
it is on that device before in the process: a fit's epochs of a few batches (side_by_side's
3) then replay three steps of three, not two. Why not a step whose shapes never ran: the first
run of a kernel may set things up (a library's plan, a module's loading) that belong
outside a capture, as torch's CUDA-graph notes ask of a warm-up.
Before the first recording on a device, one call more runs on the recorder's stream
(:meth:`Recorder.warm_up`: lazy set-ups such as a library's workspace for that stream
happen outside capture, as torch's CUDA-graph notes ask); the stream is one per device
(:func:`recorder_for`), so that happens once a process. Why not every group epoch: a
fit's epoch may have few batches (side_by_side.sh's 16-env work: 3), and each call not
replayed costs a whole step's launches. A call of another layout (a loader's shorter
last batch) runs as it is. A recording that fails (out of memory, or an operation a
graph cannot hold, such as a plugin's host read) leaves nothing changed, since recording
runs no kernel: that epoch's steps then run as they are, with a warning that names the error,
and that recorder (its stream) records nothing more for the rest of the process. Why not
try again next epoch: a host read fails every time, and torch's capture may leave an
invalidated capture's stream routed to the dead graph's memory pool. The host steps share
a device's recorder (:func:`recorder_for`); the PPO update and the policy's act each have
one of their own (:func:`own_recorder`), so their failures leave the host steps recording.

Which devices record: those with a :class:`Recorder` in :data:`RECORDERS` (CUDA). Elsewhere
the step runs as it is.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor

#: What a recorded step returns (``GraphedStep``'s outputs).
Out = TypeVar("Out")

#: Calls of a layout that run unrecorded before the one that is recorded: the first (it
#: makes what a step makes once, such as a first momentum buffer), none for a step with
#: ``shapes`` that ran before (:class:`GraphedStep`). A recorder not yet warmed up runs
#: one more, its warm-up.
CALLS_BEFORE_RECORDING = 1
#: Per recorder, the ``(shapes, layout)`` of the steps that ran as they are on its device,
#: the last :data:`SHAPES_KEPT` of them (a long run's growth makes new shapes without end).
SHAPES_KEPT = 256


class Recorder(Protocol):
    """Records a step's device work once and returns what replays it."""

    #: Whether :meth:`warm_up` has run: recordings need one warm-up before the first.
    warmed: bool
    #: The error of a recording that failed, after which none is tried (None: none failed).
    refused: BaseException | None

    def warm_up(self, step: Callable[[], None]) -> None:
        """Run ``step`` as it is, where :meth:`record` will record it; sets ``warmed``."""

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Record ``step``'s device work without running it; return its replay."""


class CudaGraphRecorder:
    """Records on a side stream of ``device`` into a ``torch.cuda.CUDAGraph``.

    ``torch.cuda.graph`` would also synchronise the device and empty the caching
    allocator before every capture (to free memory for the graph); a group records once
    an epoch, and emptying the cache each time would hand the next epoch's allocations
    back to ``cudaMalloc``. So this calls the graph's ``capture_begin``/``capture_end``
    on the side stream itself, in ``thread_local`` mode (other threads, such as a
    telemetry writer, may use CUDA meanwhile)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.warmed = False
        self.refused: BaseException | None = None

    def warm_up(self, step: Callable[[], None]) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                step()
        finally:  # also after a failed step: what it did on the stream comes first
            current.wait_stream(self.stream)
        self.warmed = True

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    step()
                except BaseException:
                    # End the (maybe invalidated) capture; the step's error is the one to see.
                    with contextlib.suppress(RuntimeError):
                        graph.capture_end()
                    raise
                graph.capture_end()
        finally:
            current.wait_stream(self.stream)
        return graph.replay


#: Recorders by device type; a device type not here runs every step as it is.
RECORDERS: dict[str, Callable[[torch.device], Recorder]] = {"cuda": CudaGraphRecorder}
#: The recorder of each device, made once: its stream is warmed up once a process.
_made: dict[tuple[Callable[[torch.device], Recorder], torch.device], Recorder] = {}


def recorder_for(device: torch.device) -> Recorder | None:
    """``device``'s recorder (one a device and maker: see the module docstring), or None
    where its type has none."""
    make = RECORDERS.get(device.type)
    if make is None:
        return None
    device = _indexed(device)
    key = (make, device)
    if key not in _made:
        _made[key] = make(device)
    return _made[key]


def own_recorder(device: torch.device) -> Recorder | None:
    """A recorder of ``device`` apart from the one its host steps share: its own stream,
    warm-up and refusal, for a step whose failed recording must not stop the host steps'
    (``esper.mdp.recorded_act``). None where ``device``'s type has none."""
    make = RECORDERS.get(device.type)
    return None if make is None else make(_indexed(device))


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Layout(NamedTuple):
    """What a recording depends on of a tensor: where it differs, a recording of one
    does not read the other."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def tensor_layout(t: Tensor) -> Layout:
    return Layout(t.shape, t.stride(), t.dtype, t.device)


#: Bytes of alignment a recorded input keeps from the tensor it was made from: the CUDA
#: caching allocator's block alignment (a CPU's allocations are 64-byte aligned).
INPUT_ALIGNMENT = 512


class _StaticInput:
    """Where a recorded step reads one input: ``view`` has the layout of the tensor it
    was made from (an expanded leading dimension stays expanded, so the recorded kernels
    are those a call of that tensor runs), ``target`` is what each call copies into.

    ``target`` also sits as far off an :data:`INPUT_ALIGNMENT`-byte boundary as that
    tensor: an env's share is a view of the batch at an offset, and a kernel may round a
    misaligned input otherwise (a CPU's addmm does, on rows of 6 floats 8 bytes off), so
    an aligned copy would not give the unrecorded call's bits."""

    def __init__(self, like: Tensor) -> None:
        self.expanded = like.dim() > 0 and like.shape[0] > 1 and like.stride(0) == 0
        source = like[0] if self.expanded else like
        self.target = _placed_like(source)
        self.view = self.target.expand(like.shape) if self.expanded else self.target

    def fill(self, t: Tensor) -> None:
        self.target.copy_(t[0] if self.expanded else t, non_blocking=True)


def _placed_like(source: Tensor) -> Tensor:
    """An empty tensor of ``source``'s shape and strides where it is dense (else
    contiguous, as ``empty_like``), starting as far off an :data:`INPUT_ALIGNMENT`-byte
    boundary as ``source`` does."""
    dense = torch.empty_like(source)  # preserve_format: the strides to keep
    size = source.element_size()
    off = source.data_ptr() % INPUT_ALIGNMENT
    if off == 0 or off % size or source.numel() == 0:
        return dense
    extent = 1 + sum((n - 1) * st for n, st in zip(dense.shape, dense.stride(), strict=True))
    room = torch.empty(extent + INPUT_ALIGNMENT // size, dtype=source.dtype, device=source.device)
    shift = (off - room.data_ptr() % INPUT_ALIGNMENT) % INPUT_ALIGNMENT // size
    return room.as_strided(dense.shape, dense.stride(), shift)


#: Per recorder, the ``(shapes, layout)`` keys of steps that ran as they are there, least
#: recently run first (:data:`SHAPES_KEPT`).
_ran: weakref.WeakKeyDictionary[Recorder, OrderedDict[Hashable, None]] = weakref.WeakKeyDictionary()


def _ran_before(recorder: Recorder, key: Hashable) -> bool:
    ran = _ran.get(recorder)
    if ran is None or key not in ran:
        return False
    ran.move_to_end(key)  # used: kept longest
    return True


def _note_ran(recorder: Recorder, key: Hashable) -> None:
    ran = _ran.setdefault(recorder, OrderedDict())
    ran[key] = None
    ran.move_to_end(key)
    while len(ran) > SHAPES_KEPT:
        ran.popitem(last=False)


class GraphedStep(Generic[Out]):
    """``step(*inputs)`` (a host step: ``x, y``) recorded at the second call of a layout
    (the third where the recorder warms up first) and replayed after it; with ``shapes``,
    at the first call where a step of those ``shapes`` and that layout ran as it is on the
    recorder's device before (the module docstring says when that may be asked).

    ``step`` does device work only (see the module docstring) and may return tensors it
    made (its outputs). Each call returns ``(*inputs, outputs)``: the inputs the step read
    (the static ones where it replayed) and the outputs of this call, which, where it
    replayed, are the recording's, in the graph's memory: the next replay overwrites them,
    so a caller that keeps them copies them. ``on_failure`` is called with the error when
    a recording fails (the call then runs as it is, and so do all later ones of every
    step of that recorder).
    """

    def __init__(
        self,
        step: Callable[..., Out],
        recorder: Recorder,
        on_failure: Callable[[BaseException], None] | None = None,
        shapes: Hashable | None = None,
    ) -> None:
        self._step = step
        self._recorder = recorder
        self._on_failure = on_failure or _warn_unrecorded
        #: What the step's kernels' shapes depend on besides its inputs' layout; None: the
        #: step makes something at its first call, which therefore always runs as it is.
        self._shapes = shapes
        self._layout: tuple[Layout, ...] | None = None
        self._calls = 0
        self._inputs: tuple[_StaticInput, ...] | None = None
        self._replay: Callable[[], None] | None = None
        self._outputs: Out | None = None
        #: Calls replayed, recorded and run as they are (host-side counts, for tests and
        #: benchmarks: what share of a group's steps the graph took).
        self.replays = 0
        self.recordings = 0
        self.unrecorded = 0

    def __call__(self, *inputs: Tensor) -> tuple[Any, ...]:
        layout = tuple(tensor_layout(t) for t in inputs)
        if self._replay is not None and layout == self._layout:
            assert self._inputs is not None
            for static, t in zip(self._inputs, inputs, strict=True):
                static.fill(t)
            self._replay()
            self.replays += 1
            return (*(static.view for static in self._inputs), self._outputs)
        if self._replay is not None or self._recorder.refused is not None:
            return self._unrecorded(inputs, layout)
        if layout != self._layout:
            self._layout, self._calls = layout, 0
        self._calls += 1
        if self._calls <= self._calls_before_recording(layout):
            return self._unrecorded(inputs, layout)
        if not self._recorder.warmed:
            made: list[Out] = []
            self._recorder.warm_up(lambda: made.append(self._step(*inputs)))
            self._ran(layout)
            self.unrecorded += 1
            return (*inputs, made[0])
        return self._record_and_replay(inputs, layout)

    def _calls_before_recording(self, layout: tuple[Layout, ...]) -> int:
        if self._shapes is not None and _ran_before(self._recorder, (self._shapes, layout)):
            return 0
        return CALLS_BEFORE_RECORDING

    def _ran(self, layout: tuple[Layout, ...]) -> None:
        if self._shapes is not None:
            _note_ran(self._recorder, (self._shapes, layout))

    def _unrecorded(
        self, inputs: tuple[Tensor, ...], layout: tuple[Layout, ...]
    ) -> tuple[Any, ...]:
        outputs = self._step(*inputs)
        self._ran(layout)
        self.unrecorded += 1
        return (*inputs, outputs)

    def _record_and_replay(
        self, inputs: tuple[Tensor, ...], layout: tuple[Layout, ...]
    ) -> tuple[Any, ...]:
        statics = tuple(_StaticInput(t) for t in inputs)
        for static, t in zip(statics, inputs, strict=True):
            static.fill(t)
        views = tuple(static.view for static in statics)
        made: list[Out] = []
        try:
            replay = self._recorder.record(lambda: made.append(self._step(*views)))
        except RuntimeError as error:  # torch.OutOfMemoryError among them
            self._recorder.refused = error
            self._on_failure(error)
            return self._unrecorded(inputs, layout)
        self._inputs, self._replay, self._outputs = statics, replay, made[0]
        self.recordings += 1
        replay()
        self.replays += 1
        return (*views, made[0])


def _warn_unrecorded(error: BaseException) -> None:
    warnings.warn(
        f"cuda_graphs: a host training step could not be recorded as a CUDA "
        f"graph ({type(error).__name__}: {error}); its device records no step for the "
        "rest of this run. Results are unchanged; set cuda_graphs to false to keep from "
        "trying.",
        RuntimeWarning,
        stacklevel=3,
    )
