"""What every host offers (kasmina/hosts/base.py) and the host registry (hosts/__init__.py)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import HOSTS, CNNHost, GateSignals, HostModel, TransformerHost
from esper.kasmina.hosts.base import integer_roundings
from tests.kasmina.factories import FAST, HOST_KINDS, make_host


def test_host_registry_holds_the_builtin_hosts() -> None:
    assert HOSTS.get("cnn") is CNNHost
    assert HOSTS.get("transformer") is TransformerHost
    for name in ("cnn", "transformer"):
        assert issubclass(HOSTS.get(name), HostModel)
        assert HOSTS.get(name).kind == name


def test_host_registry_rejects_non_host_classes() -> None:
    from esper.kasmina.hosts import _as_host_class

    with pytest.raises(TypeError, match=r"subclass of esper\.kasmina\.hosts\.HostModel"):
        _as_host_class("x", torch.nn.Linear)
    with pytest.raises(TypeError, match=r"subclass of esper\.kasmina\.hosts\.HostModel"):
        _as_host_class("x", CNNHost())


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_unknown_slot_raises_key_error_listing_the_slots(kind: str) -> None:
    host = make_host(kind)
    with pytest.raises(KeyError, match=f"no slot 'nope'; its slots are .*{host.slot_ids[0]}"):
        host.slot("nope")


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_slot_lookup_and_iteration_agree(kind: str) -> None:
    host = make_host(kind)
    assert [s.slot_id for s in host.iter_slots()] == list(host.slot_ids)
    for slot_id in host.slot_ids:
        assert host.slot(slot_id).slot_id == slot_id


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_host_parameters_exclude_live_seeds_and_include_fossilized_ones(kind: str) -> None:
    host = make_host(kind, lifecycle=FAST)
    bare = {id(p) for p in host.parameters()}
    assert {id(p) for p in host.host_parameters()} == bare
    assert host.seed_param_count() == 0

    live, fossil = host.slot_ids[:2]
    host.slot(live).germinate("norm", BlendMode.LINEAR)
    host.slot(fossil).germinate("mlp", BlendMode.GATED)
    good = GateSignals(grads_finite=True, contribution=1.0)
    while host.slot(fossil).stage is not SeedStage.FOSSILIZED:
        if not host.slot(fossil).advance(good):
            host.slot(fossil).end_epoch()

    live_ids = {id(p) for p in host.slot(live).seed_parameters()}
    fossil_ids = {id(p) for p in host.slot(fossil).seed_parameters()}
    assert {id(p) for p in host.host_parameters()} == bare | fossil_ids
    assert not live_ids & {id(p) for p in host.host_parameters()}
    assert host.seed_param_count() == sum(
        p.numel() for p in host.slot(live).seed_parameters()
    ) + sum(p.numel() for p in host.slot(fossil).seed_parameters())


def random_targets_and_logits(
    kind: str, targets: tuple[int, ...], logits: tuple[int, ...], requires_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """Class targets of leading shape ``targets`` and logits of leading shape ``logits``
    for ``make_host(kind)``: 10 classes per image, or 11 tokens at each of 8 positions."""
    per_sample = () if kind == "cnn" else (8,)
    classes = 10 if kind == "cnn" else 11
    return (
        torch.randint(0, classes, (*targets, *per_sample)),
        torch.randn(*logits, *per_sample, classes, requires_grad=requires_grad),
    )


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_per_replica_loss_and_correct_match_each_replica_alone(kind: str) -> None:
    host = make_host(kind)
    torch.manual_seed(3)
    targets, outputs = random_targets_and_logits(kind, (4,), (3 * 4,))
    correct = host.correct_per_replica(outputs, targets, replicas=3)
    losses = host.loss_per_replica(outputs, targets, replicas=3)
    assert correct.shape == losses.shape == (3,)
    for r in range(3):
        chunk = outputs[r * 4 : (r + 1) * 4]
        loss, n_correct, n = host.loss_and_correct(chunk, targets)
        assert int(correct[r]) == int(n_correct)
        assert torch.allclose(losses[r], loss * n, rtol=1e-5)


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_per_env_loss_and_correct_match_each_env_alone_and_the_mapped_default(
    kind: str,
) -> None:
    host = make_host(kind)
    torch.manual_seed(4)
    targets, outputs = random_targets_and_logits(kind, (5, 4), (5, 4), requires_grad=True)
    losses, correct = host.loss_and_correct_per_env(outputs, targets)
    mapped_losses, mapped_correct = HostModel.loss_and_correct_per_env(host, outputs, targets)
    assert losses.shape == correct.shape == (5,)
    assert torch.equal(correct, mapped_correct)
    torch.testing.assert_close(losses, mapped_losses, rtol=1e-6, atol=0)
    for g in range(5):
        loss, n_correct, _ = host.loss_and_correct(outputs[g], targets[g])
        assert torch.equal(correct[g], n_correct)
        torch.testing.assert_close(losses[g], loss, rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(losses.sum(), outputs)
    (mapped_grad,) = torch.autograd.grad(mapped_losses.sum(), outputs)
    torch.testing.assert_close(grad, mapped_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_per_env_replica_sums_match_each_env_alone_and_the_mapped_default(kind: str) -> None:
    host = make_host(kind)
    torch.manual_seed(5)
    targets, outputs = random_targets_and_logits(kind, (4,), (5, 3 * 4))
    losses, correct = host.loss_and_correct_per_replica_per_env(outputs, targets, 3)
    mapped = HostModel.loss_and_correct_per_replica_per_env(host, outputs, targets, 3)
    assert losses.shape == correct.shape == (5, 3)
    assert torch.equal(correct, mapped[1])
    torch.testing.assert_close(losses, mapped[0], rtol=1e-6, atol=0)
    for g in range(5):
        assert torch.equal(correct[g], host.correct_per_replica(outputs[g], targets, 3))
        torch.testing.assert_close(
            losses[g], host.loss_per_replica(outputs[g], targets, 3), rtol=1e-6, atol=0
        )


def test_a_host_family_without_widened_kwargs_says_to_implement_it() -> None:
    class Plain(HostModel):
        """A family that never implemented the hook (its other methods are not needed)."""

        from_data = check_input = loss_and_correct = None  # type: ignore[assignment]

    with pytest.raises(NotImplementedError, match=r"Plain has no widened_kwargs.*static_equal"):
        Plain.widened_kwargs({}, 2.0)


@pytest.mark.parametrize(
    ("value", "step", "minimum", "expected"),
    [
        (6.4, 1, 1, (6, 7)),
        (6.0, 1, 1, (6,)),
        (10.0, 4, 4, (8, 12)),
        (12.0, 4, 4, (12,)),
        (0.3, 1, 1, (1,)),
        (1.5, 4, 4, (4,)),
    ],
)
def test_integer_roundings_are_the_multiples_of_step_around_a_value(
    value: float, step: int, minimum: int, expected: tuple[int, ...]
) -> None:
    assert integer_roundings(value, step, minimum) == expected
