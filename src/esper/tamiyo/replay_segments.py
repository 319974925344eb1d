"""A replayed rollout cut where its chains of LSTM states break, laid out for one fused call.

Why: a governor restore (or an episode reset after step 0) breaks an env's chain of
states: the step after it acts from a stored state (or zeros), not from the previous
step's output. The replay then stepped the LSTM through every step of every env in Python,
about 45 kernels a step forward and backward, where an unbroken rollout runs one fused
call: on the side-by-side work at 16 envs (``benchmarks/ppo_update.py``) 11 594 kernel
operators an update against 4 974, and on the GPU, where launches are the cost, a rollout
with one restore cost its PPO update about twice. Cut at its breaks, each env's sequence is
a few unbroken segments, each from a state the buffer stored; padded to the longest, the
segments are the rows of one fused LSTM call, and each step's output is gathered back.

Shapes: ``E`` envs, ``T`` steps, ``S`` segments, ``L`` steps in the longest.

A layout depends on the breaks alone, so the last :data:`LAYOUTS_KEPT` are kept
(:func:`layout_of`): a minibatch whose envs break where an earlier one's did finds its
indices on the device already, which is what lets a recorded minibatch pass
(``esper.simic.ppo_graph``) replay its segments: a CUDA graph cannot record the upload
of indices made on the host, and it records the kept ones' addresses.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SegmentLayout:
    """Where each segment's steps come from and where its outputs go, as flat indices.

    ``steps [S*L]``: the ``[E*T]`` position of each padded segment step's input (a
    segment shorter than ``L`` is padded with the steps after it, clamped to its env's
    last: their outputs are dropped, and an LSTM's output never depends on later steps);
    ``firsts [S]``: the ``[E*T]`` position of each segment's first step, whose stored state
    it starts from; ``outputs [E*T]``: the ``[S*L]`` position of each step's output.
    """

    segments: int
    length: int
    steps: Tensor
    firsts: Tensor
    outputs: Tensor


def segment_layout(
    breaks: Sequence[Sequence[int]], n_steps: int, device: torch.device
) -> SegmentLayout:
    """The layout of ``E = len(breaks)`` sequences of ``n_steps`` steps, env ``e`` cut
    before each step of ``breaks[e]`` (ascending, each in ``[1, n_steps)``); its indices
    made host-side and uploaded in one copy that does not wait for the device."""
    steps: list[int] = []
    firsts: list[int] = []
    outputs: list[int] = [0] * (len(breaks) * n_steps)
    spans: list[tuple[int, int, int]] = []
    for env, cuts in enumerate(breaks):
        if any(not 0 < t < n_steps for t in cuts) or any(
            a >= b for a, b in itertools.pairwise(cuts)
        ):
            raise ValueError(
                f"env {env}: breaks must ascend strictly within [1, {n_steps}), got {list(cuts)}"
            )
        bounds = [0, *cuts, n_steps]
        spans += [(env, a, b) for a, b in itertools.pairwise(bounds)]
    length = max(b - a for _, a, b in spans)
    last = n_steps - 1
    for s, (env, a, b) in enumerate(spans):
        base = env * n_steps
        firsts.append(base + a)
        steps += [base + min(a + j, last) for j in range(length)]
        for t in range(a, b):
            outputs[base + t] = s * length + t - a
    both = torch.tensor(steps + firsts + outputs, dtype=torch.long)
    if device.type == "cuda":
        both = both.pin_memory()
    both = both.to(device, non_blocking=True)
    n = len(spans) * length
    return SegmentLayout(
        segments=len(spans),
        length=length,
        steps=both[:n],
        firsts=both[n : n + len(spans)],
        outputs=both[n + len(spans) :],
    )


#: Segment layouts kept on their devices (:func:`layout_of`): a minibatch's breaks are
#: those of its envs, so an update of ``E`` envs with restores in a few has few distinct
#: ones; each is a few hundred indices.
LAYOUTS_KEPT = 64


@functools.lru_cache(maxsize=LAYOUTS_KEPT)
def _kept_layout(
    breaks: tuple[tuple[int, ...], ...], n_steps: int, device: torch.device
) -> SegmentLayout:
    return segment_layout(breaks, n_steps, device)


def layout_of(breaks: Sequence[Sequence[int]], n_steps: int, device: torch.device) -> SegmentLayout:
    """:func:`segment_layout`, kept for the next caller with the same breaks (its tensors
    are never written)."""
    return _kept_layout(tuple(tuple(cuts) for cuts in breaks), n_steps, device)


#: A fused LSTM over ``rows [S, L, H]`` from ``start`` (``(h, c)`` each ``[layers, S, H]``),
#: each row's state zeroed first where ``resets [S]`` is true: ``[S, L, H]``.
Recurrence = Callable[[Tensor, tuple[Tensor, Tensor], Tensor], Tensor]


def replay_in_segments(
    recur: Recurrence,
    x: Tensor,
    stored_hidden: tuple[Tensor, Tensor],
    episode_starts: Tensor,
    breaks: Sequence[Sequence[int]],
) -> Tensor:
    """The LSTM outputs ``[E, T, H]`` over ``x [E, T, H]``, each env cut before each step of
    its ``breaks``, each segment run by one ``recur`` call from its first step's stored
    state (``(h, c)`` each ``[E, T, layers, H]``), zeroed where that step starts an episode
    (``episode_starts [E, T]`` bool), as the step loop restarts it there."""
    n_envs, n_steps = x.shape[:2]
    layout = layout_of(breaks, n_steps, x.device)
    rows = x.reshape(n_envs * n_steps, -1).index_select(0, layout.steps)
    # [layers, S, H], contiguous: cuDNN's RNN takes no strided state.
    h, c = (
        s.reshape(n_envs * n_steps, *s.shape[2:])
        .index_select(0, layout.firsts)
        .transpose(0, 1)
        .contiguous()
        for s in stored_hidden
    )
    resets = episode_starts.reshape(-1).index_select(0, layout.firsts)
    out = recur(rows.view(layout.segments, layout.length, -1), (h, c), resets)
    flat = out.reshape(layout.segments * layout.length, -1)
    return flat.index_select(0, layout.outputs).view(n_envs, n_steps, -1)
