"""Counting the aten operators a block runs, for tests that pin how much work a path issues."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.benchmarks.loading import load_benchmark

#: ``benchmarks/launch_rule.py``: which operators launch a kernel, as every count there.
_launch_rule = load_benchmark("launch_rule")


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


class LaunchCounter(TorchDispatchMode):
    """Within the block, the operators that launch a kernel on a GPU, by name, as the
    benchmarks count them (``benchmarks/launch_rule.py``: no views, bare allocations or
    operators on empty tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _launch_rule.launches(func, out):
            self.ops[func.overloadpacket.__name__] += 1
        return out
