"""Which part of each training batch an env trains on (``esper.tolaria.epoch.run_epoch``),
alone or stacked with others.

Every batch is split into one share per env, or with paired groups into ``paired_group``
shares of which every env trains on share ``b mod paired_group``. A stacked group
(``esper.tolaria.stacked``) takes its members' shares as one ``[G, ...]`` tensor, a view
of the batch wherever the split allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def env_share(
    batch: tuple[Tensor, Tensor], b: int, env: int, n_envs: int, paired_group: int | None
) -> tuple[Tensor, Tensor]:
    """The part of batch number ``b`` that env ``env`` trains on: share ``env`` of ``n_envs``,
    or with ``paired_group`` share ``b mod paired_group`` (see
    :func:`esper.tolaria.epoch.run_epoch`)."""
    shares, share = (n_envs, env) if paired_group is None else (paired_group, b % paired_group)
    x, y = batch
    return x.tensor_split(shares)[share], y.tensor_split(shares)[share]


def group_shares(
    batch: tuple[Tensor, Tensor],
    b: int,
    indices: list[int],
    rows: Tensor | None,
    n_envs: int,
    paired_group: int | None,
) -> tuple[Tensor, Tensor] | None:
    """The shares of batch ``b`` that the envs ``indices`` train on, stacked ``[G, ...]``
    (:func:`env_share`), or None where they differ in size.

    No per-env copies where the split is even: the batch viewed as ``[n_envs, share, ...]``
    and sliced (``rows`` None: consecutive envs) or gathered by ``rows``; with paired
    groups, the one share every env trains on, expanded over the members.
    """
    x, y = batch
    if paired_group is not None:  # every env trains on the same share
        xs, ys = env_share(batch, b, indices[0], n_envs, paired_group)
        return xs.expand(len(indices), *xs.shape), ys.expand(len(indices), *ys.shape)
    if x.shape[0] % n_envs:
        shares = [env_share(batch, b, i, n_envs, None) for i in indices]
        if len({xi.shape[0] for xi, _ in shares}) > 1:
            return None
        return torch.stack([xi for xi, _ in shares]), torch.stack([yi for _, yi in shares])
    xv = x.view(n_envs, x.shape[0] // n_envs, *x.shape[1:])
    yv = y.view(n_envs, y.shape[0] // n_envs, *y.shape[1:])
    if rows is None:
        return xv[indices[0] : indices[-1] + 1], yv[indices[0] : indices[-1] + 1]
    return xv.index_select(0, rows), yv.index_select(0, rows)


def by_share_size(
    groups: list[list[int]], batch_size: int, n_envs: int, paired_group: int | None, fewest: int
) -> tuple[list[list[int]], list[int]]:
    """``groups`` of env indices split where their members' shares of a batch of
    ``batch_size`` differ in size, and the envs of parts smaller than ``fewest`` (or with
    empty shares), which train alone.

    Why: a stacked step needs its members' shares as one ``[G, b, ...]`` tensor. When the
    batch does not split evenly over the envs, :func:`env_share` gives the first
    ``batch_size % n_envs`` envs one row more than the others, in every batch of that
    size; a group split there stacks every batch instead of none. With paired groups
    every env trains on the same share, so no group splits.
    """
    longer = batch_size % n_envs  # envs below this index take one row more
    if paired_group is not None or longer == 0:
        return groups, []
    shorter_have_rows = batch_size > n_envs  # else the envs from ``longer`` on have none
    parts: list[list[int]] = []
    alone: list[int] = []
    for members in groups:
        longer_part = [i for i in members if i < longer]
        shorter_part = [i for i in members if i >= longer]
        for part, stackable in ((longer_part, True), (shorter_part, shorter_have_rows)):
            if stackable and len(part) >= fewest:
                parts.append(part)
            else:
                alone += part
    return parts, sorted(alone)


def index_on(device: torch.device, values: list[int]) -> Tensor:
    """``values`` as an index tensor on ``device`` (:func:`uploaded`)."""
    return uploaded(device, values, torch.long)


def uploaded(device: torch.device, values: Sequence[Any], dtype: torch.dtype) -> Tensor:
    """``values`` (a list, or a list of equal-length lists) as a tensor on ``device``,
    copied without stalling the host: a plain copy from pageable memory to a GPU waits
    for the work queued before it, so it goes through pinned memory, non-blocking."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def consecutive(indices: list[int]) -> bool:
    """Whether ``indices`` (ascending) are one run of consecutive envs: their shares are
    then one slice of an evenly split batch."""
    return indices == list(range(indices[0], indices[-1] + 1))
