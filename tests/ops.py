"""Counting the aten operators a block runs, for tests that pin how much work a path issues."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Within the block, every aten operator by name (``ops``), and the names of the
    autograd nodes whose backward ran one (``backward_nodes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.backward_nodes: set[str] = set()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        node = torch._C._current_autograd_node()
        if node is not None:
            self.backward_nodes.add(node.name())
        return func(*args, **(kwargs or {}))
