"""The host's forward and loss, and its ``torch.compile`` built once per process.

``run_epoch(compile=True)`` runs each host's forward and loss (and so its backward)
through one compiled function shared by every env.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from esper.kasmina.hosts.base import HostModel


def forward_loss(model: HostModel, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """The host's forward and loss: the part of a train step worth compiling."""
    loss, correct, _ = model.loss_and_correct(model(x), y)
    return loss, correct


#: Recompilations allowed per compiled function: each combination of slot stages is its
#: own graph, and a host with several slots meets a few dozen combinations in a run.
COMPILE_RECOMPILE_LIMIT = 128
_compiled_forward_loss: Callable[[HostModel, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None


def compiled_forward_loss() -> Callable[[HostModel, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``torch.compile`` of :func:`forward_loss`, built once and shared by every env.

    Dynamo treats a module's parameters as inputs, so hosts of one architecture share the
    compiled graphs; a slot changing stage selects (or compiles) another graph.
    """
    global _compiled_forward_loss
    if _compiled_forward_loss is None:
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, COMPILE_RECOMPILE_LIMIT
        )
        _compiled_forward_loss = torch.compile(forward_loss)
    return _compiled_forward_loss
