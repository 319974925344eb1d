"""CUDA side streams for host training: each env trains on its own stream, so small hosts
on one GPU overlap instead of queueing behind each other on the default stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from esper.kasmina.growing_host import GrowingHost


def env_streams(envs: Sequence[GrowingHost]) -> list[torch.cuda.Stream | None]:
    """A side stream per env on its CUDA device; None for envs elsewhere."""
    streams: list[torch.cuda.Stream | None] = []
    for env in envs:
        if env.device.type != "cuda":
            streams.append(None)
            continue
        stream = torch.cuda.Stream(env.device)
        # The env's weights were last touched on its device's main stream.
        stream.wait_stream(torch.cuda.current_stream(env.device))
        streams.append(stream)
    return streams


@contextlib.contextmanager
def on_stream(
    stream: torch.cuda.Stream | None, device: torch.device, inputs: tuple[Tensor, ...]
) -> Iterator[None]:
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))  # the batch was copied on main
    for t in inputs:
        t.record_stream(stream)  # keep the batch's memory alive until this stream is done
    with torch.cuda.stream(stream):
        yield
