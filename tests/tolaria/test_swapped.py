"""A model's forward with other tensors swapped in: what ``functional_call`` computes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost, TransformerHost
from esper.tolaria.swapped import Swapped
from tests.tolaria.test_epoch import FAST, to_stage


def _others(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    buffers = {name: b.clone() + 1 for name, b in model.named_buffers()}
    return params, buffers


@pytest.mark.parametrize("host", ["cnn", "transformer"])
def test_a_swapped_forward_computes_what_functional_call_does_and_leaves_the_model(
    host: str,
) -> None:
    torch.manual_seed(0)
    env = GrowingHost(CNNHost(lifecycle=FAST) if host == "cnn" else TransformerHost())
    env.germinate(env.slot_ids[0], "widen" if host == "cnn" else "mlp", BlendMode.GATED)
    to_stage(env, env.slot_ids[0], SeedStage.BLENDING)
    model = env.model.eval()
    x = torch.randn(3, *model.input_shape) if host == "cnn" else torch.randint(0, 16, (3, 8))
    own = {name: t.clone() for name, t in model.state_dict().items()}
    params, buffers = _others(model)
    with torch.no_grad():
        ours = Swapped(model)(params, buffers, x)
        theirs = functional_call(model, (params, buffers), (x,))
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, model(x))  # the swapped tensors were the ones used
    for name, t in model.state_dict().items():
        assert torch.equal(t, own[name]), name


def test_a_tied_tensor_is_swapped_in_every_place_and_unnamed_ones_stay() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 2))
    params = {"0.weight": torch.eye(4), "0.bias": torch.zeros(4)}  # "3.*" left as they are
    x = torch.randn(5, 4)
    weight = shared.weight
    with torch.no_grad():
        ours = Swapped(model)(params, {}, x)
        # (on a copy: with a module used twice, functional_call leaves the swapped
        # tensor in the model, torch 2.13)
        theirs = functional_call(copy.deepcopy(model), params, (x,))
    assert torch.equal(ours, theirs)
    assert model[0].weight is model[2].weight is weight


def test_the_models_tensors_are_put_back_when_the_forward_raises() -> None:
    model = nn.Linear(4, 2)
    weight = model.weight
    with pytest.raises(RuntimeError):
        Swapped(model)({"weight": torch.randn(3, 3)}, {}, torch.randn(5, 4))
    assert model.weight is weight
    with pytest.raises(KeyError, match=r"no parameter or buffer 'wieght'.*named_parameters"):
        Swapped(model)({"wieght": torch.randn(2, 4)}, {}, torch.randn(5, 4))
    assert model.weight is weight


def test_under_vmap_each_env_runs_its_own_tensors() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    stacked = {name: torch.randn(5, *p.shape) for name, p in model.named_parameters()}
    x = torch.randn(5, 6, 4)
    ours = vmap(Swapped(model), in_dims=(0, None, 0))(stacked, {}, x)
    for g in range(5):
        own = {name: p[g] for name, p in stacked.items()}
        torch.testing.assert_close(ours[g], functional_call(model, own, (x[g],)))
