"""Intra-op thread counts on the CPU, set for a block and given back.

Two parts of Esper want a count of their own, apart from the process's:

- The policy (``PolicyConfig.cpu_threads``, one by default) acts on one row per env and
  updates on a few hundred transitions: too little work to share between cores, and on a
  CPU that trains its hosts in worker threads a second thread for the policy sleeps
  through every host epoch and has to be woken for the next act, which stalled acts
  many times over (measured: benchmarks/README.md, "Design figures kept out of docstrings").
- Host training in worker threads (``esper.tolaria.parallel``): one worker per env up to
  the cores torch uses, each running its ops on an even share of those cores (one where
  there are at least as many envs as cores), so the workers neither oversubscribe the
  cores nor leave spare ones idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """Run the block's CPU ops on ``count`` intra-op threads, then restore the count the
    calling thread had; None leaves it as it is."""
    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
