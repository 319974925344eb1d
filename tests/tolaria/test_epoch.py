"""run_epoch: per-env training on disjoint shares, fused validation with counterfactuals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from esper.contracts import BlendMode, SeedStage
from esper.host_reads import HostReadCounter
from esper.kasmina import CNNHost, GrowingHost, LifecycleConfig, TransformerHost
from esper.kasmina.incubation import incubating_slots, incubation_loss
from esper.kasmina.lifecycle import GateSignals
from esper.tolaria.epoch import run_epoch
from tests.tolaria.loaders import image_loaders, token_loaders

N_ENVS = 4
PASS = GateSignals(grads_finite=True, contribution=1.0)
#: Lets a seed reach BLENDING/HOLDING without waiting epochs, so tests stay short.
FAST = LifecycleConfig(min_training_epochs=0, blend_epochs=2, min_holding_epochs=0)


def to_stage(env: GrowingHost, slot_id: str, stage: SeedStage) -> None:
    """Advance one slot, letting epochs pass (on that slot only) where a gate asks for them."""
    slot = env.model.slot(slot_id)
    for _ in range(10):
        if slot.stage >= stage:
            return
        if not env.advance(slot_id, PASS):
            slot.end_epoch()
    raise AssertionError(f"{slot_id} stuck at {slot.stage.name}: {slot.lifecycle.last_refusal}")


def cnn_envs() -> list[GrowingHost]:
    """Four envs whose seeds cover every stage run_epoch treats differently."""
    torch.manual_seed(0)
    envs = [GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST)) for _ in range(N_ENVS)]
    envs[1].germinate("stage0", "conv_light", BlendMode.LINEAR)
    to_stage(envs[1], "stage0", SeedStage.TRAINING)
    envs[2].germinate("stage0", "norm", BlendMode.GATED)
    to_stage(envs[2], "stage0", SeedStage.BLENDING)
    envs[2].model.slot("stage0").end_epoch()  # alpha > 0
    envs[2].germinate("stage1", "mlp", BlendMode.COSINE)
    to_stage(envs[2], "stage1", SeedStage.TRAINING)
    envs[3].germinate("stage1", "depthwise", BlendMode.SIGMOID)
    to_stage(envs[3], "stage1", SeedStage.HOLDING)
    return envs


def test_run_epoch_for_four_envs_reads_nothing_on_the_host() -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    with HostReadCounter() as counter:
        result = run_epoch(envs, train, val)
    assert counter.count == 0, counter.report()
    assert result.val_acc.shape == (N_ENVS,)
    assert result.cf_val_acc.shape == (N_ENVS, 2)


def test_transformer_envs_read_nothing_on_the_host() -> None:
    torch.manual_seed(0)
    envs = [
        GrowingHost(TransformerHost(seq_len=12, d_model=32, lifecycle=FAST)) for _ in range(N_ENVS)
    ]
    envs[0].germinate("block0", "attention", BlendMode.LINEAR)
    to_stage(envs[0], "block0", SeedStage.BLENDING)
    envs[1].germinate("block1", "lora", BlendMode.LINEAR)
    to_stage(envs[1], "block1", SeedStage.TRAINING)
    train, val = token_loaders()
    with HostReadCounter() as counter:
        result = run_epoch(envs, train, val)
    assert counter.count == 0, counter.report()
    assert bool(result.loss_finite.all())
    assert ((result.val_acc >= 0) & (result.val_acc <= 1)).all()


def test_each_env_trains_exactly_on_its_own_share_of_every_batch() -> None:
    envs = cnn_envs()
    reference = copy.deepcopy(envs)
    train, val = image_loaders()
    result = run_epoch(envs, train, val)

    for i, ref in enumerate(reference):
        ref.model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        for x, y in train:
            xe, ye = x.tensor_split(N_ENVS)[i], y.tensor_split(N_ENVS)[i]
            ref.zero_grad()
            out = ref.model(xe)
            loss, c, n = ref.model.loss_and_correct(out, ye)
            loss.backward()
            incubating = incubating_slots(ref.model)  # TRAINING seeds learn in their own pass
            if incubating:
                incubation_loss(ref.model, incubating, xe, ye).backward()
            ref.step()
            loss_sum += loss.item() * n
            correct += int(c)
            seen += n
        for p, q in zip(envs[i].model.parameters(), ref.model.parameters(), strict=True):
            assert torch.equal(p, q)
        assert result.train_loss[i].item() == pytest.approx(loss_sum / seen, rel=1e-6)
        assert result.train_acc[i].item() == pytest.approx(correct / seen)


def _plain_val_acc(env: GrowingHost, val: DataLoader) -> float:
    env.model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in val:
            correct += int((env.model(x).argmax(-1) == y).sum())
            total += y.numel()
    env.model.train()
    return correct / total


def test_counterfactual_equals_accuracy_with_that_seed_switched_off() -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    result = run_epoch(envs, train, val)
    for i, env in enumerate(envs):
        assert result.val_acc[i].item() == pytest.approx(_plain_val_acc(env, val))
        for s, slot in enumerate(env.model.iter_slots()):
            if slot.stage in (SeedStage.BLENDING, SeedStage.HOLDING):
                switched_off = copy.deepcopy(env)
                switched_off.model.slot(slot.slot_id)._alpha_t.fill_(0.0)
                expected = _plain_val_acc(switched_off, val)
            else:
                expected = result.val_acc[i].item()
            assert result.cf_val_acc[i, s].item() == pytest.approx(expected), (i, slot.slot_id)


def test_counterfactual_forks_are_cleared_after_validation() -> None:
    envs = cnn_envs()
    run_epoch(envs, *image_loaders())
    assert all(slot._cf_fork is None for env in envs for slot in env.model.iter_slots())
    assert all(env.model.training for env in envs)


def test_blending_seed_moves_validation_away_from_its_counterfactual() -> None:
    envs = cnn_envs()
    train, val = image_loaders()
    for _ in range(2):
        result = run_epoch(envs, train, val)
    # env 3 holds a HOLDING seed at alpha 1: its counterfactual is a different network.
    logits_on = _val_logits(envs[3], val)
    off = copy.deepcopy(envs[3])
    off.model.slot("stage1")._alpha_t.fill_(0.0)
    assert not torch.equal(logits_on, _val_logits(off, val))
    assert result.cf_val_acc[0].eq(result.val_acc[0]).all()  # env 0 has no seed


def _val_logits(env: GrowingHost, val: DataLoader) -> torch.Tensor:
    env.model.eval()
    with torch.no_grad():
        out = torch.cat([env.model(x) for x, _ in val])
    env.model.train()
    return out


def test_non_finite_seed_gradients_are_flagged_for_that_slot_only() -> None:
    envs = cnn_envs()
    with torch.no_grad():
        next(envs[1].model.slot("stage0").seed.parameters()).fill_(float("nan"))
    result = run_epoch(envs, *image_loaders())
    flags = result.seed_grads_finite
    assert not flags[1, 0]
    assert flags[1, 1] and flags[0].all() and flags[2].all() and flags[3].all()
    assert result.loss_finite[0] and result.loss_finite[2]


def test_non_finite_training_loss_is_flagged() -> None:
    envs = cnn_envs()
    with torch.no_grad():
        envs[0].model.head.weight.fill_(float("inf"))
    result = run_epoch(envs, *image_loaders())
    assert not result.loss_finite[0]
    assert result.loss_finite[1:].all()


def test_language_model_accuracy_counts_tokens() -> None:
    torch.manual_seed(0)
    env = GrowingHost(TransformerHost(seq_len=12, d_model=32))
    train, val = token_loaders()
    result = run_epoch([env], train, val)
    env.model.eval()
    with torch.no_grad():
        correct = sum(int((env.model(x).argmax(-1) == y).sum()) for x, y in val)
    assert result.val_acc[0].item() == pytest.approx(correct / (16 * 12))


def test_contribution_is_accuracy_minus_counterfactual() -> None:
    envs = cnn_envs()
    result = run_epoch(envs, *image_loaders())
    assert torch.equal(result.contribution, result.val_acc[:, None] - result.cf_val_acc)


def test_no_envs_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one env"):
        run_epoch([], *image_loaders())


def test_envs_with_different_slots_are_refused() -> None:
    envs = [GrowingHost(CNNHost(channels=(8,))), GrowingHost(CNNHost(channels=(8, 16)))]
    with pytest.raises(ValueError, match="same host architecture"):
        run_epoch(envs, *image_loaders())


def test_a_batch_too_small_to_share_is_refused() -> None:
    envs = [GrowingHost(CNNHost(channels=(8,))) for _ in range(N_ENVS)]
    x, y = torch.randn(2, 1, 8, 8), torch.randint(0, 10, (2,))
    with pytest.raises(ValueError, match="one per env"):
        run_epoch(envs, [(x, y)], [(x, y)])


def test_empty_validation_is_refused() -> None:
    envs = [GrowingHost(CNNHost(channels=(8,)))]
    train, _ = image_loaders()
    with pytest.raises(ValueError, match="no samples"):
        run_epoch(envs, train, [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_give_the_same_result_as_cpu() -> None:
    cpu_envs = cnn_envs()
    gpu_envs = copy.deepcopy(cpu_envs)
    for env in gpu_envs:
        env.model.cuda()
        env.host_optimizer = type(env.host_optimizer)(
            env.model.host_parameters(), **env.host_optimizer.defaults
        )
    train, val = image_loaders()
    with HostReadCounter() as counter:
        result = run_epoch(gpu_envs, train, val)
    assert counter.count == 0, counter.report()
    assert result.val_acc.device.type == "cuda"
