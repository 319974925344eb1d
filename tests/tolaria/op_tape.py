"""A CUDA graph's rules on a CPU, for testing what records steps (``esper.tolaria.step_graph``).

CI has no GPU, and a step that a CUDA graph records can go wrong in ways an eager step
never shows: Python bookkeeping done once at recording and never again, a batch read
from a tensor other than the static inputs, a read of a device tensor on the host. A
:class:`TapeRecorder` holds a step to the same rules on any device: ``record`` notes every
aten operator the step issues with its arguments and outputs (a ``TorchDispatchMode``:
the forward, autograd's backward and the optimizer alike), puts back every tensor it
found as it was (a recording runs no kernel), and refuses host reads, and tensors made
from Python data (which a GPU would copy from the host), as capture does; its replay
issues the same operators on the same tensors and copies each fresh output into the
tensor recorded for it, so that later operators, and later steps, find their inputs
where the recording left them, as a graph's fixed memory does. It runs the same kernels
in the same order as the step, so replays equal eager steps bit for bit.

Not a production recorder: it is slower than running the step (a Python call per
operator), and on a CPU nothing asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Operators that read a device tensor's values on the host (a CUDA capture fails on
#: them): scalar reads, and outputs whose size depends on the values.
HOST_READS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "is_nonzero",
        "equal",
        "allclose",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
    }
)


#: Operators that make a tensor from Python data (``torch.tensor``, ``torch.as_tensor``):
#: on a GPU that data is copied from the host, which a capture cannot hold either.
HOST_DATA = frozenset({"lift_fresh", "lift_fresh_copy"})


class HostReadWhileRecording(RuntimeError):
    """A recorded step read a device tensor on the host, or made one from host data."""


#: An operator, its arguments, its outputs and whether grad mode was on (some kernels,
#: such as oneDNN's LSTM layer, keep a workspace for the backward only in grad mode).
_Op = tuple[Any, tuple, dict, Any, bool]


def _tensors(value: object) -> list[Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, Tensor)]


def _overlaps_itself(t: Tensor) -> bool:
    """An expanded tensor: no operator may write it, so nothing to put back."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        #: Each tensor an operator took that no recorded operator made, with its values
        #: from before that operator: what recording may have written. (Schemas do not
        #: say it for every operator: ``native_batch_norm`` writes its running
        #: statistics without marking them.)
        self.before: list[tuple[Tensor, Tensor]] = []
        self._known: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            t.dtype == torch.bool for t in _tensors(args[1:]) + _tensors(kwargs)
        )
        if name in HOST_READS or bool_index:
            raise HostReadWhileRecording(
                f"{func} reads a device tensor on the host: a CUDA graph cannot record it"
            )
        if name in HOST_DATA:
            raise HostReadWhileRecording(
                f"{func} makes a tensor from host data: on a GPU it would be copied from "
                "the host, which a CUDA graph cannot record"
            )
        for tensor in _tensors((args, kwargs)):
            if id(tensor) not in self._known and not _overlaps_itself(tensor):
                self._known.add(id(tensor))
                self.before.append((tensor, tensor.detach().clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, torch.is_grad_enabled()))
        self._known.update(id(t) for t in _tensors(out))  # kept alive by ``ops``
        return out


class TapeRecorder:
    """:class:`esper.tolaria.step_graph.Recorder` on any device, to a CUDA graph's rules."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        #: Operators of each recording, and replays of any, for tests that count them.
        self.recorded: list[int] = []
        self.replays = 0
        self.warmed = False
        self.refused: BaseException | None = None

    def warm_up(self, step: Callable[[], None]) -> None:
        step()
        self.warmed = True

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        tape = _Tape()
        rng = torch.random.get_rng_state()
        try:
            with tape:
                step()
        finally:  # a recording runs no kernel: put back what it wrote, also when it fails
            with torch.no_grad():
                for tensor, before in reversed(tape.before):
                    tensor.copy_(before)
            torch.random.set_rng_state(rng)  # nor draws a random number
        self.recorded.append(len(tape.ops))
        ops = tape.ops

        def replay() -> None:
            self.replays += 1
            # Below autograd (a replay records no graph), in the grad mode each operator
            # was recorded in.
            with torch._C._AutoDispatchBelowAutograd():
                for func, args, kwargs, recorded, grad_mode in ops:
                    with torch.set_grad_enabled(grad_mode):
                        fresh = func(*args, **kwargs)
                    for new, old in zip(_tensors(fresh), _tensors(recorded), strict=True):
                        if new is not old and new.data_ptr() != old.data_ptr():
                            old.copy_(new)

        return replay
