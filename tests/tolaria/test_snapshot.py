"""Snapshot → train → restore gives back the very same weights, optimizer state and seeds."""

from __future__ import annotations

import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost
from esper.kasmina.lifecycle import GateSignals
from esper.tolaria.epoch import run_epoch
from esper.tolaria.snapshot import HostSnapshot
from tests.ops import OpCounter
from tests.tolaria.loaders import image_loaders

PASS = GateSignals(grads_finite=True, contribution=1.0)


def _state(env: GrowingHost) -> dict[str, object]:
    """Everything that must come back: weights, buffers, optimizer states, lifecycles."""
    return {
        "model": {k: v.clone() for k, v in env.model.state_dict().items()},
        "host_opt": _opt_state(env.host_optimizer),
        "seed_opts": {k: _opt_state(o) for k, o in env.seed_optimizers.items()},
        "stages": {
            s.slot_id: (s.stage, s.lifecycle.epochs_in_stage) for s in env.model.iter_slots()
        },
    }


def _opt_state(opt: torch.optim.Optimizer) -> dict[str, object]:
    sd = opt.state_dict()
    return {
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
        "groups": sd["param_groups"],
    }


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert a == b


def _trained_env() -> GrowingHost:
    torch.manual_seed(0)
    env = GrowingHost(CNNHost(channels=(8, 16)))
    env.germinate("stage0", "conv_light", BlendMode.LINEAR)
    env.advance("stage0", PASS)
    run_epoch([env], *image_loaders())  # momentum buffers exist from here on
    env.end_epoch()
    return env


def test_snapshot_train_restore_gives_identical_weights_and_optimizer_state() -> None:
    env = _trained_env()
    before = _state(env)
    snap = HostSnapshot.take(env, epoch=1)
    run_epoch([env], *image_loaders())
    env.end_epoch()
    assert not torch.equal(
        before["model"]["stages.0.body.0.weight"], env.model.stages[0].body[0].weight
    )

    snap.restore(env)
    _assert_same(before, _state(env))


def test_restore_undoes_seeds_planted_and_fossilized_since_the_snapshot() -> None:
    env = _trained_env()
    snap = HostSnapshot.take(env, epoch=1)
    n_host_params = len(env.model.host_parameters())
    env.germinate("stage1", "norm", BlendMode.LINEAR)
    env.prune("stage0")
    snap.restore(env)
    assert env.model.slot("stage1").stage is SeedStage.DORMANT
    assert env.model.slot("stage0").stage is SeedStage.TRAINING
    assert set(env.seed_optimizers) == {"stage0"}
    assert len(env.model.host_parameters()) == n_host_params


def test_restored_optimizers_drive_the_restored_parameters() -> None:
    env = _trained_env()
    snap = HostSnapshot.take(env, epoch=1)
    snap.restore(env)
    model_params = {id(p) for p in env.model.parameters()}
    opt_params = {id(p) for g in env.host_optimizer.param_groups for p in g["params"]}
    seed_params = {id(p) for g in env.seed_optimizers["stage0"].param_groups for p in g["params"]}
    assert opt_params | seed_params == model_params
    assert seed_params == {id(p) for p in env.model.slot("stage0").seed_parameters()}


def test_a_snapshot_survives_training_after_restore_and_can_be_restored_twice() -> None:
    env = _trained_env()
    before = _state(env)
    snap = HostSnapshot.take(env, epoch=1)
    snap.restore(env)
    run_epoch([env], *image_loaders())  # must not write into the snapshot's tensors
    snap.restore(env)
    _assert_same(before, _state(env))
    assert snap.epoch == 1


def _tensors(env: GrowingHost) -> list[torch.Tensor]:
    states = [
        value
        for opt in (env.host_optimizer, *env.seed_optimizers.values())
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return [*env.model.parameters(), *env.model.buffers(), *states]


def test_a_snapshot_copies_its_tensors_in_a_few_multi_tensor_copies() -> None:
    """A clone a tensor was a kernel launch each, dozens an env and snapshot; the copies
    are the snapshot's own and parameters stay parameters, frozen ones frozen."""
    env = _trained_env()
    env.model.host_parameters()[0].requires_grad_(False)
    tensors = _tensors(env)
    empty = sum(t.numel() == 0 for t in tensors)  # nothing to copy: deepcopy's own way
    with OpCounter() as counted:
        snap = HostSnapshot.take(env, epoch=1)
    assert counted.ops["clone"] == 0
    assert counted.ops["copy_"] <= empty
    assert counted.ops["_foreach_copy_"] <= 2  # float32 and int64, as the tensors are
    originals = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    for original, copy in zip(env.model.parameters(), snap.model.parameters(), strict=True):
        assert type(copy) is type(original) and copy.requires_grad == original.requires_grad
        assert copy.untyped_storage().data_ptr() not in originals
        assert torch.equal(copy, original)


def test_a_view_of_another_buffer_stays_a_view_of_its_copy() -> None:
    """Tensors that share storage are left to deepcopy, which keeps the tie."""
    env = _trained_env()
    norm = env.model.stages[0].norms()[0]
    norm.register_buffer("first_means", norm.running_mean[:2])
    snap = HostSnapshot.take(env, epoch=1)
    copied = snap.model.stages[0].norms()[0]
    assert copied.running_mean.data_ptr() != norm.running_mean.data_ptr()
    assert copied.first_means.data_ptr() == copied.running_mean.data_ptr()
    assert torch.equal(copied.first_means, norm.first_means)
