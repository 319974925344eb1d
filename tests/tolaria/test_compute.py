"""Training compute is counted from the layers a training step ran, once per host state."""

from __future__ import annotations

import copy

import pytest
import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost, TransformerHost
from esper.kasmina.lifecycle import GateSignals
from esper.tolaria.compute import PROBE_SAMPLES, TrainingCompute

IMAGES = (torch.randn(4, 1, 8, 8), torch.tensor([1, 2, 3, 4]))


def _tiny_cnn() -> GrowingHost:
    torch.manual_seed(0)
    return GrowingHost(CNNHost((1, 8, 8), 10, channels=[2, 4], convs_per_stage=1))


def test_a_plain_host_costs_its_multiply_adds_forward_and_backward() -> None:
    """Worked by hand: conv 1->2 at 8x8 (1152 MACs), conv 2->4 at 4x4 (1152), linear 4->10
    (40). Forward 2 * 2344 FLOPs; backward as much again for the weight gradients plus the
    input gradients of every layer but the first (its input needs none)."""
    forward = 2 * (1152 + 1152 + 40)
    backward = forward + 2 * (1152 + 40)
    assert TrainingCompute(IMAGES).per_prediction(_tiny_cnn()) == forward + backward


def test_each_stage_counts_the_layers_it_runs() -> None:
    meter = TrainingCompute(IMAGES)
    host = _tiny_cnn()
    plain = meter.per_prediction(host)
    host.germinate("stage1", "conv_wide", BlendMode.LINEAR)
    assert meter.per_prediction(host) == plain  # GERMINATED: the seed does not run yet
    slot = host.model.slot("stage1")
    assert host.advance("stage1", GateSignals())
    training = meter.per_prediction(host)  # plus the incubation pass
    slot.lifecycle.epochs_in_stage = 10
    assert host.advance("stage1", GateSignals())
    assert slot.stage is SeedStage.BLENDING
    blending = meter.per_prediction(host)  # the seed in the host's own step
    assert plain < blending < training
    slot.lifecycle.epochs_in_stage = 10
    assert host.advance("stage1", GateSignals())
    assert meter.per_prediction(host) == blending  # HOLDING: alpha 1, the same layers


def test_a_host_state_is_measured_once_and_the_probe_leaves_the_host_alone() -> None:
    meter = TrainingCompute(IMAGES)
    host = _tiny_cnn()
    host.germinate("stage0", "conv_light", BlendMode.LINEAR)
    assert host.advance("stage0", GateSignals())
    before = copy.deepcopy(host.model.state_dict())
    calls = []
    measure = meter._measure
    meter._measure = lambda h: calls.append(1) or measure(h)  # type: ignore[method-assign]
    first = meter.per_prediction(host)
    assert meter.per_prediction(host) == first
    assert calls == [1]
    after = host.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights, BN statistics
    assert all(p.grad is None for p in host.model.parameters())
    assert host.host_optimizer.state == {}  # no momentum appeared


def test_a_transformer_counts_per_token_and_an_epoch_is_cost_times_predictions() -> None:
    tokens = torch.randint(0, 16, (PROBE_SAMPLES, 32))
    meter = TrainingCompute((tokens, tokens))
    per_token = meter.per_prediction(GrowingHost(TransformerHost()))
    assert per_token > 0
    assert meter.epoch_flops([per_token, 2.0], [10, 3]) == [10 * per_token, 6.0]
    with pytest.raises(ValueError, match="at least 2 samples"):
        TrainingCompute((tokens[:1], tokens[:1]))
