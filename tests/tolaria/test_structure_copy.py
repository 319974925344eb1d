"""deepcopy_structure copies as copy.deepcopy(objects, memo) does, by one pickle pass."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost, TransformerHost
from esper.kasmina.blueprints import BLUEPRINTS
from esper.kasmina.lifecycle import GateSignals
from esper.tolaria import structure_copy
from esper.tolaria.epoch import run_epoch
from esper.tolaria.structure_copy import deepcopy_structure
from tests.tolaria.loaders import image_loaders

PASS = GateSignals(grads_finite=True, contribution=1.0)


def _grown_env() -> GrowingHost:
    """A host with a seed blending in and momentum in both optimizers."""
    torch.manual_seed(0)
    env = GrowingHost(CNNHost(channels=(8, 16)))
    env.germinate("stage0", "conv_light", BlendMode.LINEAR)
    env.advance("stage0", PASS)
    run_epoch([env], *image_loaders())
    env.end_epoch()
    env.advance("stage0", PASS)
    assert env.model.slot("stage0").stage is SeedStage.BLENDING
    return env


def _objects(env: GrowingHost) -> tuple:
    return env.model, env.host_optimizer, env.seed_optimizers


def _values_memo(objects: tuple) -> dict[int, object]:
    """A memo with a fresh copy of every parameter and buffer (as the snapshot's)."""
    model = objects[0]
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach().clone()) for p in model.parameters()}
    memo.update({id(b): b.clone() for b in model.buffers()})
    return memo


def test_a_grown_host_and_its_optimizers_pickle_without_falling_back() -> None:
    env = _grown_env()
    tensors: list[torch.Tensor] = []
    structure_copy._dump(_objects(env), _values_memo(_objects(env)), tensors)
    assert tensors, "the tensors went by position, not into the pickle"


def test_the_copy_is_what_deepcopy_with_the_same_memo_gives() -> None:
    env = _grown_env()
    objects = _objects(env)
    memo = _values_memo(objects)
    model, host_opt, seed_opts = deepcopy_structure(objects, dict(memo))
    ref_model, ref_host_opt, ref_seed_opts = copy.deepcopy(objects, dict(memo))

    assert type(model) is type(ref_model) and model is not env.model
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref_model.named_modules()]
    for (name, p), (_, q) in zip(
        model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        assert p is q, f"{name}: the memo's tensor, as deepcopy takes it"
    for a, b in zip(model.iter_slots(), ref_model.iter_slots(), strict=True):
        assert (a.stage, a.lifecycle.epochs_in_stage) == (b.stage, b.lifecycle.epochs_in_stage)
        assert a.lifecycle is not env.model.slot(a.slot_id).lifecycle
    # The optimizers drive the copied parameters, and their momentum is copied.
    assert host_opt.param_groups[0]["params"][0] is ref_host_opt.param_groups[0]["params"][0]
    assert seed_opts.keys() == ref_seed_opts.keys()
    for name, opt in seed_opts.items():
        original = env.seed_optimizers[name]
        for p, q in zip(
            opt.param_groups[0]["params"], original.param_groups[0]["params"], strict=True
        ):
            assert p is not q
            momentum, source = opt.state[p]["momentum_buffer"], original.state[q]["momentum_buffer"]
            assert momentum is not source and torch.equal(momentum, source)
    assert host_opt.param_groups[0]["lr"] == env.host_optimizer.param_groups[0]["lr"]


def test_tensors_outside_the_memo_are_deepcopied_and_views_stay_views() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.arange(6.0)
            self.view = self.base[2:]

    holder = Holder()
    copied = deepcopy_structure(holder, {})
    assert copied.base is not holder.base and torch.equal(copied.base, holder.base)
    assert copied.view._base is copied.base or (
        copied.view.untyped_storage().data_ptr() == copied.base.untyped_storage().data_ptr()
    )
    copied.base[2] = 100.0
    assert copied.view[0] == 100.0 and holder.view[0] == 2.0


def test_a_tensor_never_goes_through_pickles_own_reduction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pickle's reduction of a GPU tensor copies it to the host, which waits for the
    device: every tensor, of every tensor type, must go by position."""

    class Tagged(nn.Parameter):
        pass

    def refuse(self: torch.Tensor, protocol: int) -> None:
        raise AssertionError("a tensor reached pickle's own reduction")

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", refuse)
    objects = {"plain": torch.ones(3), "tagged": Tagged(torch.zeros(2))}
    tensors: list[torch.Tensor] = []
    data = structure_copy._dump(objects, {}, tensors)
    assert len(tensors) == 2 and data
    copied = deepcopy_structure(objects, {})
    assert torch.equal(copied["plain"], objects["plain"]) and type(copied["tagged"]) is Tagged


def test_what_does_not_pickle_falls_back_to_deepcopy() -> None:
    model = nn.Linear(2, 2)
    model.scale = lambda x: 2 * x  # a lambda pickles by reference, and fails
    memo = _values_memo((model,))
    copied = deepcopy_structure(model, memo)
    assert copied is not model and copied.scale is model.scale
    assert copied.weight is memo[id(model.weight)]


def test_ordered_dicts_keep_their_order_and_attributes() -> None:
    mapping = OrderedDict([("b", 1), ("a", 2)])
    mapping.note = "kept"
    copied = deepcopy_structure([mapping, mapping], {})
    assert copied[0] is copied[1] and copied[0] is not mapping
    assert list(copied[0].items()) == [("b", 1), ("a", 2)] and copied[0].note == "kept"


@pytest.mark.parametrize("shared", [True, False])
def test_objects_shared_within_the_copy_stay_shared(shared: bool) -> None:
    inner = [1, 2]
    objects = (inner, inner if shared else [1, 2])
    copied = deepcopy_structure(objects, {})
    assert (copied[0] is copied[1]) is shared and copied[0] is not inner


def _every_seed() -> list[tuple[str, str]]:
    """(host kind, blueprint) for every registered blueprint and built-in host it fits."""
    return [
        (kind, name)
        for name in BLUEPRINTS.names()
        for kind in ("cnn", "transformer")
        if kind in BLUEPRINTS.get(name).host_kinds
    ]


@pytest.mark.parametrize(("kind", "blueprint"), _every_seed())
def test_every_blueprint_s_seed_pickles_without_falling_back(kind: str, blueprint: str) -> None:
    """A seed that did not pickle (a lambda on a module, say) would make every snapshot of
    its host take deepcopy's slower path without a word: this names it."""
    host = CNNHost(channels=(16, 32)) if kind == "cnn" else TransformerHost()
    env = GrowingHost(host)
    slot_id = env.slot_ids[0]
    env.germinate(slot_id, blueprint, BlendMode.LINEAR)
    env.advance(slot_id, PASS)
    structure_copy._dump(_objects(env), {}, [])
