"""Snapshots of one env's growing host, for the governor's per-env rollback.

A snapshot must capture the model (host weights, every slot's seed and lifecycle state,
gate refusals included, BatchNorm statistics) and the optimizers (momentum buffers)
*together*: restoring weights without momentum, or a seed without its optimizer, would
resume a different run. One ``deepcopy`` of all three keeps the optimizers pointing at the
copied parameters.

Copies stay on the env's device (device-to-device, no host read); restoring swaps the
copied objects in, so a seed planted or pruned since the snapshot is undone as well.

The deepcopy's tensors (parameters, buffers, optimizer state) are made by a few
multi-tensor copies (:class:`~esper.tolaria.copies.Copies`) and handed to ``deepcopy`` in
its memo, so it copies only the Python objects around them. Why: cloned one by one, a
16-env rollout's snapshots were about 5 800 of the 25 000 kernel-launching operators of a
PPO update on the side-by-side work (a snapshot is taken of every env at an episode's
start and after each fossilization or routine epoch); on the device machine, where a
launch costs tens of microseconds of CPU, the launches are the cost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.tolaria.copies import Copies
from esper.tolaria.structure_copy import deepcopy_structure


@dataclass(frozen=True)
class HostSnapshot:
    """A frozen copy of one env's host, seeds and optimizers; ``epoch`` says when it was taken."""

    model: HostModel
    host_optimizer: torch.optim.Optimizer
    seed_optimizers: dict[str, torch.optim.Optimizer]
    epoch: int

    @classmethod
    def take(cls, env: GrowingHost, epoch: int, copies: Copies | None = None) -> HostSnapshot:
        """``env``'s snapshot. With ``copies``, its tensors' copies join those (the caller
        runs them, several snapshots' in one go, before anything changes ``env``'s
        tensors; until then the snapshot's tensors hold nothing)."""
        model, host_opt, seed_opts = _deepcopy(
            (env.model, env.host_optimizer, env.seed_optimizers), copies
        )
        return cls(model, host_opt, seed_opts, epoch)

    def restore(self, env: GrowingHost) -> None:
        """Put the snapshot's state back into ``env``; the snapshot stays reusable."""
        model, host_opt, seed_opts = _deepcopy(
            (self.model, self.host_optimizer, self.seed_optimizers)
        )
        env.model = model
        env.host_optimizer = host_opt
        env.seed_optimizers = seed_opts


def _deepcopy(
    objects: tuple[HostModel, torch.optim.Optimizer, dict[str, torch.optim.Optimizer]],
    copies: Copies | None = None,
) -> tuple[HostModel, torch.optim.Optimizer, dict[str, torch.optim.Optimizer]]:
    """``copy.deepcopy(objects)``, its tensors copied in a few multi-tensor copies (run
    here, or left in ``copies`` for the caller to run) and the objects around them by
    pickle (:func:`~esper.tolaria.structure_copy.deepcopy_structure`)."""
    model, host_optimizer, seed_optimizers = objects
    optimizers = [host_optimizer, *seed_optimizers.values()]
    states = (
        value for opt in optimizers for state in opt.state.values() for value in state.values()
    )
    mine = copies is None
    copies = Copies() if copies is None else copies
    memo = _tensor_copies([*model.parameters(), *model.buffers(), *states], copies)
    if mine:
        copies.run()
    return deepcopy_structure(objects, memo)


def _tensor_copies(objects: Iterable[Any], copies: Copies) -> dict[int, Any]:
    """A ``deepcopy`` memo holding a copy of each tensor of ``objects`` that a plain copy
    of its values reproduces (a parameter as a parameter), its copy added to ``copies``.

    A tensor that shares its storage with another of ``objects`` (a view, say), or that
    carries more than its values (a gradient, attributes, a tensor subclass, another
    layout), is left to ``deepcopy``, which keeps those; so is anything not a tensor. The
    tensors a snapshot copies are its model's parameters and buffers and its optimizers'
    states: a view of one of them held elsewhere in the model would lose its tie to the
    copy (no module here holds one; ``tests/tolaria/test_snapshot.py``)."""
    tensors = {id(t): t for t in objects if isinstance(t, Tensor)}.values()
    sharing = Counter(_storage(t) for t in tensors)
    memo: dict[int, Any] = {}
    for tensor in tensors:
        if sharing[_storage(tensor)] > 1 or not _plain(tensor):
            continue
        fresh = copies.copy_of(tensor)
        if type(tensor) is nn.Parameter:
            fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fresh
    return memo


def _storage(tensor: Tensor) -> tuple[torch.device, int]:
    """Which storage ``tensor`` reads (a key of its own where it has none to share)."""
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return tensor.device, -id(tensor)
    return tensor.device, tensor.untyped_storage().data_ptr()


def _plain(tensor: Tensor) -> bool:
    """Whether ``tensor``'s copy is its values alone: a dense, non-empty tensor that owns
    its whole storage, with no gradient or attributes (a parameter's ``deepcopy`` keeps
    neither its gradient nor attributes, so a parameter needs only the first)."""
    extra = (
        type(tensor) is not Tensor
        or tensor.requires_grad
        or tensor.grad is not None
        or bool(tensor.__dict__)
    )
    if type(tensor) is not nn.Parameter and extra:
        return False
    return (
        tensor.layout == torch.strided
        and tensor.numel() > 0
        and tensor._base is None
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
