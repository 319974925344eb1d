"""The CPU stand-in for a CUDA graph that tests of recorded steps use (``tests/tolaria/op_tape.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from esper.kasmina.sgd import sgd_step
from tests.tolaria.op_tape import HostReadWhileRecording, TapeRecorder


def model_and_step() -> tuple[nn.Module, torch.optim.SGD, torch.Tensor, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        nn.functional.cross_entropy(model(x), y).backward()
        sgd_step([optimizer])

    return model, optimizer, x, y, step


def test_a_recording_changes_nothing_and_its_replays_equal_eager_steps_bit_for_bit() -> None:
    """Recorded after one eager step (the momentum buffers exist), then replayed on new
    batches copied into the recorded inputs: the same weights, statistics and momentum as
    eager steps on those batches."""
    eager, eager_opt, x, y, eager_step = model_and_step()
    taped, taped_opt, tx, ty, taped_step = model_and_step()
    eager_step()
    taped_step()
    before = {k: v.clone() for k, v in taped.state_dict().items()}
    recorder = TapeRecorder()
    replay = recorder.record(taped_step)  # type: ignore[arg-type]
    assert recorder.recorded[0] > 20  # forward, backward and SGD operators
    for k, v in taped.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} moved while recording"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        new_x, new_y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        x.copy_(new_x)
        y.copy_(new_y)
        eager_step()  # type: ignore[operator]
        tx.copy_(new_x)
        ty.copy_(new_y)
        replay()
    assert recorder.replays == 3
    for k, v in eager.state_dict().items():
        assert torch.equal(v, taped.state_dict()[k]), k
    for p, q in zip(eager.parameters(), taped.parameters(), strict=True):
        assert torch.equal(
            eager_opt.state[p]["momentum_buffer"], taped_opt.state[q]["momentum_buffer"]
        )


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: float(t.sum()),
        lambda t: t.nonzero(),
        lambda t: t[t > 0],
        lambda t: bool(t.sum() > 0),
        lambda t: t + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    ],
    ids=["item", "float", "nonzero", "mask_index", "bool", "host_data"],
)
def test_a_host_read_while_recording_is_refused_and_undone(read: object) -> None:
    """As a CUDA capture fails on a host read, so does the tape; what the step wrote
    before it is put back."""
    t = torch.ones(4)

    def step() -> None:
        t.add_(1)
        read(t)  # type: ignore[operator]

    with pytest.raises(HostReadWhileRecording):
        TapeRecorder().record(step)
    assert torch.equal(t, torch.ones(4))
