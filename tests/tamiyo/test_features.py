"""Observations land where the layout says, device part and host part alike."""

from __future__ import annotations

import pytest
import torch

from esper.contracts import ObservationLayout, SeedStage
from esper.host_reads import HostReadCounter
from esper.tamiyo.features import EnvState, ObservationBuilder, SlotState
from esper.tolaria.epoch import EpochResult

LAYOUT = ObservationLayout(n_slots=2, n_blueprints=3)


def _result() -> EpochResult:
    return EpochResult(
        train_loss=torch.tensor([0.5, float("inf")]),
        train_acc=torch.tensor([0.8, 0.1]),
        val_loss=torch.tensor([0.6, float("nan")]),
        val_acc=torch.tensor([0.75, 0.2]),
        cf_val_acc=torch.tensor([[0.75, 0.70], [0.2, 0.2]]),
        loss_finite=torch.tensor([True, False]),
        seed_grads_finite=torch.ones(2, 2, dtype=torch.bool),
    )


def _envs() -> list[EnvState]:
    slot_a = SlotState(SeedStage.BLENDING, 2, 0.5, 1, False)
    slot_b = SlotState(SeedStage.DORMANT, 0, 0.0, None, True)
    return [EnvState(5, 300, [slot_a, slot_b]), EnvState(5, 0, [slot_b, slot_b])]


def test_features_are_at_their_named_positions() -> None:
    builder = ObservationBuilder(
        LAYOUT, episode_epochs=10, param_budget=1000, device=torch.device("cpu")
    )
    obs = builder.build(_result(), torch.tensor([0.7, 0.2]), torch.tensor([0.75, 0.3]), _envs())
    assert obs.shape == (2, LAYOUT.dim)

    def at(name: str) -> torch.Tensor:
        s = LAYOUT[name]
        return obs[:, s.start : s.stop]

    assert at("epoch_fraction")[:, 0].tolist() == [0.5, 0.5]
    assert at("params_ratio")[0, 0].item() == pytest.approx(0.3)
    assert at("val_acc_delta")[0, 0].item() == pytest.approx(0.05, abs=1e-6)
    assert at("slot1.contribution")[0, 0].item() == pytest.approx(0.05, abs=1e-6)
    assert at("slot0.alpha")[0, 0].item() == 0.5
    assert at("slot1.gate_refused")[0, 0].item() == 1.0
    assert at("slot0.stage")[0].argmax().item() == SeedStage.BLENDING
    assert at("slot0.blueprint")[0].tolist() == [0.0, 1.0, 0.0]
    assert at("slot1.blueprint")[0].sum().item() == 0.0


def test_non_finite_losses_reach_the_policy_clamped_not_as_nan() -> None:
    builder = ObservationBuilder(LAYOUT, 10, 1000, torch.device("cpu"))
    obs = builder.build(_result(), torch.zeros(2), torch.zeros(2), _envs())
    assert torch.isfinite(obs).all()


def test_building_an_observation_reads_nothing_from_the_device() -> None:
    builder = ObservationBuilder(LAYOUT, 10, 1000, torch.device("cpu"))
    result, envs = _result(), _envs()
    with HostReadCounter() as counter:
        builder.build(result, torch.zeros(2), torch.zeros(2), envs)
    assert counter.count == 0, counter.report()
