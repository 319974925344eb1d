"""Small, seeded hosts and batches shared by the kasmina tests (not a test module)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from esper.kasmina import CNNHost, HostModel, LifecycleConfig, TransformerHost
from esper.kasmina.blueprints import BLUEPRINTS

HOST_KINDS: tuple[str, ...] = ("cnn", "transformer")

#: A lifecycle with no waiting, so a test can walk a seed to any stage quickly.
FAST = LifecycleConfig(
    min_training_epochs=0, blend_epochs=1, min_holding_epochs=0, embargo_epochs=1, reset_epochs=1
)


def make_host(kind: str, lifecycle: LifecycleConfig | None = None, seed: int = 0) -> HostModel:
    torch.manual_seed(seed)
    if kind == "cnn":
        return CNNHost((1, 8, 8), n_classes=10, channels=(16, 32), lifecycle=lifecycle)
    if kind == "transformer":
        return TransformerHost(
            vocab_size=11, seq_len=8, d_model=32, n_heads=2, n_layers=2, lifecycle=lifecycle
        )
    raise AssertionError(kind)


def make_batch(host: HostModel, n: int = 4, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(host, CNNHost):
        x = torch.randn(n, *host.input_shape, generator=g)
        y = torch.randint(0, host.n_classes, (n,), generator=g)
    else:
        assert isinstance(host, TransformerHost)
        x = torch.randint(0, host.vocab_size, (n, host.seq_len), generator=g)
        y = torch.randint(0, host.vocab_size, (n, host.seq_len), generator=g)
    return x, y


def forward_backward(host: HostModel, x: Tensor, y: Tensor) -> Tensor:
    out = host(x)
    loss, _, _ = host.loss_and_correct(out, y)
    loss.backward()
    return out.detach()


def fitting_cases(all_slots: bool = True) -> list:
    """``(host kind, slot id, blueprint)`` for every blueprint that fits a slot of the test hosts."""
    cases = []
    for kind in HOST_KINDS:
        host = make_host(kind)
        slot_ids = host.slot_ids if all_slots else host.slot_ids[:1]
        for slot_id in slot_ids:
            shape = host.slot(slot_id).shape
            for name in BLUEPRINTS.names():
                if BLUEPRINTS.get(name).fits(shape):
                    cases.append(pytest.param(kind, slot_id, name, id=f"{kind}-{slot_id}-{name}"))
    return cases


def train_backward(host: HostModel, x: Tensor, y: Tensor) -> Tensor:
    """The gradients of one host training step, as ``run_epoch`` makes them.

    The host's own forward and backward, then the incubation pass that trains seeds in
    TRAINING (``esper.kasmina.incubation``).
    """
    from esper.kasmina.incubation import incubating_slots, incubation_loss, recording_start

    slots = incubating_slots(host)
    with recording_start(host, slots) as start:
        out = forward_backward(host, x, y)
    if slots:
        incubation_loss(host, slots, x, y, start).backward()
    return out
