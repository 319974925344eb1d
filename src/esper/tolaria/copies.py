"""Many tensor copies as a few multi-tensor copies.

Why: a stacked group is built from its members' tensors at the start of an epoch and
written back into them at its end (``esper.tolaria.stacked``): a row per member of every
parameter, buffer and momentum buffer, several hundred copies for 16 envs. Copied one by
one, each is a kernel launch; on a launch-bound GPU that cost more than the epoch's
stacked steps when an epoch has few batches (and a padded stacked tensor was zeroed
before its rows were copied in, one fill each). ``torch._foreach_copy_`` copies a list in
one launch on CUDA where every pair has the same dtype, shape and strides, so the pairs
are grouped that way, and a pair that fits no such group (a narrower member's row, which
is a strided corner of the stacked one) goes with its own kind. On the CPU the same
calls copy the tensors one by one, as before.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor


class Copies:
    """Tensors to zero and ``(destination, source)`` pairs, collected, then zeroed and
    copied (in that order) by :meth:`run`."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, tuple[list[Tensor], list[Tensor]]] = {}
        self._zeros: dict[Hashable, list[Tensor]] = {}

    def zero(self, tensor: Tensor) -> None:
        """Zero ``tensor`` before any copy (a copy into part of it keeps the rest zero)."""
        self._zeros.setdefault((tensor.device, tensor.dtype), []).append(tensor)

    def add(self, destination: Tensor, source: Tensor) -> None:
        if destination.shape != source.shape:
            raise ValueError(
                f"a copy needs equal shapes, got {list(destination.shape)} from "
                f"{list(source.shape)}"
            )
        dense = destination.is_contiguous() and source.is_contiguous()
        key = (destination.device, destination.dtype, source.dtype, dense)
        destinations, sources = self._groups.setdefault(key, ([], []))
        destinations.append(destination)
        sources.append(source)

    def copy_of(self, source: Tensor) -> Tensor:
        """A fresh tensor like ``source`` (its layout kept where dense) that gets
        ``source``'s values at :meth:`run`."""
        fresh = torch.empty_like(source, memory_format=torch.preserve_format)
        self.add(fresh, source)
        return fresh

    @torch.no_grad()
    def run(self) -> None:
        """Zero every tensor and copy every pair added, and forget them."""
        for tensors in self._zeros.values():
            torch._foreach_zero_(tensors)
        for destinations, sources in self._groups.values():
            torch._foreach_copy_(destinations, sources)
        self._zeros.clear()
        self._groups.clear()
