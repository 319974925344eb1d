"""The env step's one device-to-host read: what is packed into it, and where each part sits.

Everything Python needs to carry a step out travels in one tensor, read once: at a
decision, the policy's actions, log-probs and values, the host metrics of the epoch just
trained and the governor's panic code; at the episode's last read, the critic's bootstrap
value in place of the action columns. :class:`StepRead` packs both and unpacks the host
copy by name, so no index arithmetic is spread over the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from esper.contracts.actions import N_HEADS
from esper.tamiyo.policy import ActResult


def read_packed(packed: Tensor) -> np.ndarray:
    """The one device-to-host transfer of ``packed``, as a float64 numpy array."""
    return np.asarray(packed.tolist(), dtype=np.float64)


@dataclass(frozen=True)
class StepRead:
    """The host copy of one step's packed read, ``E`` envs.

    Attributes:
        actions: ``[E, 4]`` int64 head choices; ``[E, 0]`` at the episode's last read.
        log_probs: ``[E]`` log-probability of those actions; empty at the last read.
        values: ``[E]`` the critic's value: of the decision's observation, or at the last
            read of the observation after the episode (the bootstrap).
        metrics: ``[E, M]`` the env metrics of the epoch just trained
            (``MorphogeneticVecEnv.metric_columns``).
        panic: ``[E]`` the governor's ``PANIC_*`` code of that epoch; None without one.
    """

    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    metrics: np.ndarray
    panic: np.ndarray | None

    @classmethod
    def of_decision(cls, act: ActResult, metrics: Tensor, panic: Tensor | None) -> StepRead:
        """Pack the decision's action, the epoch's metrics and panic code; read them once."""
        head = [act.actions.float(), act.log_prob[:, None].float(), act.value[:, None].float()]
        host = _read(head, metrics, panic)
        n_metrics = metrics.shape[1]
        return cls(
            actions=host[:, :N_HEADS].astype(np.int64),
            log_probs=host[:, N_HEADS],
            values=host[:, N_HEADS + 1],
            metrics=host[:, N_HEADS + 2 : N_HEADS + 2 + n_metrics],
            panic=None if panic is None else host[:, N_HEADS + 2 + n_metrics],
        )

    @classmethod
    def of_last(cls, bootstrap: Tensor, metrics: Tensor, panic: Tensor | None) -> StepRead:
        """Pack the bootstrap value ``[E]``, the last epoch's metrics and panic; read once."""
        host = _read([bootstrap[:, None].float()], metrics, panic)
        n_envs, n_metrics = host.shape[0], metrics.shape[1]
        return cls(
            actions=np.zeros((n_envs, 0), dtype=np.int64),
            log_probs=np.zeros(0),
            values=host[:, 0],
            metrics=host[:, 1 : 1 + n_metrics],
            panic=None if panic is None else host[:, 1 + n_metrics],
        )


def _read(head: list[Tensor], metrics: Tensor, panic: Tensor | None) -> np.ndarray:
    """``head`` columns, then ``metrics [E, M]``, then ``panic [E]`` if any: one read."""
    columns = [*head, metrics]
    if panic is not None:
        columns.append(panic.float()[:, None])
    return read_packed(torch.cat(columns, dim=1))
