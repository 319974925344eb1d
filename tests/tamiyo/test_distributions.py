"""MaskedCategorical: legal samples, finite entropy, exact agreement with a plain categorical."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.host_reads import HostReadCounter
from esper.tamiyo.distributions import (
    MaskedCategorical,
    ensure_any_legal,
    masked_logits,
    padded_heads,
)

#: Samples drawn when checking empirical frequencies; the tolerance below fits this count.
N_SAMPLES = 20_000
FREQ_TOL = 0.02


def _logits_and_mask(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 5, generator=g) * 3
    mask = torch.rand(64, 5, generator=g) < 0.5
    mask[0] = False  # one row with nothing legal
    mask[1] = True
    return logits, mask


def test_illegal_choices_are_never_sampled() -> None:
    logits, mask = _logits_and_mask()
    logits[~mask] += 100.0  # make the illegal ones the most attractive
    dist = MaskedCategorical(logits, mask)
    g = torch.Generator().manual_seed(1)
    legal = ensure_any_legal(mask)
    for _ in range(50):
        sample = dist.sample(g)
        assert legal.gather(-1, sample.unsqueeze(-1)).all()


def test_all_false_row_becomes_uniform_over_all_choices() -> None:
    logits = torch.zeros(2, 4)
    mask = torch.tensor([[False] * 4, [True, False, False, False]])
    dist = MaskedCategorical(logits, mask)
    torch.testing.assert_close(dist.probs[0], torch.full((4,), 0.25))
    assert dist.entropy()[0].item() == pytest.approx(math.log(4))
    assert dist.entropy()[1].item() == 0.0


def test_matches_a_plain_categorical_over_the_legal_choices() -> None:
    logits, mask = _logits_and_mask()
    dist = MaskedCategorical(logits, mask)
    legal = ensure_any_legal(mask)
    reference = torch.distributions.Categorical(logits=logits.masked_fill(~legal, -math.inf))
    torch.testing.assert_close(dist.probs, reference.probs)
    # Categorical's entropy is NaN-free here only because it clamps; ours is finite by design.
    torch.testing.assert_close(dist.entropy(), reference.entropy())
    actions = reference.sample()
    torch.testing.assert_close(dist.log_prob(actions), reference.log_prob(actions))


def test_gradients_are_finite_through_masked_entries() -> None:
    logits, mask = _logits_and_mask()
    logits.requires_grad_(True)
    dist = MaskedCategorical(logits, mask)
    actions = dist.sample(torch.Generator().manual_seed(0))
    (dist.log_prob(actions).sum() + dist.entropy().sum()).backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    # Illegal entries of rows with a legal choice get no gradient at all.
    has_legal = mask.any(-1, keepdim=True)
    assert (logits.grad[~mask & has_legal.expand_as(mask)] == 0).all()


def test_masked_logits_are_finite() -> None:
    logits, mask = _logits_and_mask()
    out = masked_logits(logits, mask)
    assert torch.isfinite(out).all()
    assert (out[~mask] == torch.finfo(logits.dtype).min).all()


def test_mode_is_the_argmax_among_legal_choices() -> None:
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0]])
    mask = torch.tensor([[False, True, True, True]])
    assert MaskedCategorical(logits, mask).mode().tolist() == [2]


def test_sample_frequencies_follow_the_probabilities() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    mask = torch.tensor([True, True, False, True])
    dist = MaskedCategorical(logits.expand(N_SAMPLES, 4), mask.expand(N_SAMPLES, 4))
    counts = torch.bincount(dist.sample(torch.Generator().manual_seed(3)), minlength=4)
    torch.testing.assert_close(
        counts.double() / N_SAMPLES, dist.probs[0].double(), atol=FREQ_TOL, rtol=0.0
    )


def test_sampling_is_reproducible_with_a_generator() -> None:
    logits, mask = _logits_and_mask()
    dist = MaskedCategorical(logits, mask)
    a = dist.sample(torch.Generator().manual_seed(7))
    b = dist.sample(torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_stay_finite(dtype: torch.dtype) -> None:
    logits, mask = _logits_and_mask()
    dist = MaskedCategorical(logits.to(dtype), mask)
    assert torch.isfinite(dist.entropy()).all()
    assert torch.isfinite(dist.log_prob(dist.mode())).all()


def test_no_host_reads() -> None:
    logits, mask = _logits_and_mask()
    g = torch.Generator().manual_seed(0)
    with HostReadCounter() as counter:
        dist = MaskedCategorical(logits, mask)
        actions = dist.sample(g)
        dist.mode()
        dist.log_prob(actions)
        dist.entropy()
    assert counter.count == 0, counter.report()


def test_rejects_mismatched_or_non_bool_masks() -> None:
    with pytest.raises(ValueError, match="shape"):
        MaskedCategorical(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        MaskedCategorical(torch.zeros(2, 3), torch.ones(2, 3))


# ------------------------------------------------------------------ padded heads
def _heads(
    widths: list[int], batch: int, seed: int, illegal: float = 0.5
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Logits (with gradients) and masks of heads of ``widths``, every head with an
    all-illegal row and an all-legal one, and an action per head and row."""
    g = torch.Generator().manual_seed(seed)
    logits = [(torch.randn(batch, k, generator=g) * 3).requires_grad_() for k in widths]
    masks = [torch.rand(batch, k, generator=g) >= illegal for k in widths]
    for mask in masks:
        mask[0] = False
        mask[1] = True
    actions = torch.stack([torch.randint(0, k, (batch,), generator=g) for k in widths], -1)
    return logits, masks, actions


def _per_head(
    logits: list[torch.Tensor], masks: list[torch.Tensor], actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference: one MaskedCategorical per head, stacked ``[B, H]``."""
    dists = [MaskedCategorical(x, m) for x, m in zip(logits, masks, strict=True)]
    log_prob = torch.stack([d.log_prob(actions[:, h]) for h, d in enumerate(dists)], -1)
    return log_prob, torch.stack([d.entropy() for d in dists], -1)


@settings(max_examples=40, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    batch=st.integers(2, 12),
    seed=st.integers(0, 2**16),
)
def test_padded_heads_score_as_each_head_alone(widths: list[int], batch: int, seed: int) -> None:
    """Log-probs, entropies and their gradients, whatever the widths, all-illegal rows too."""
    logits, masks, actions = _heads(widths, batch, seed)
    want_lp, want_ent = _per_head(logits, masks, actions)
    want_grads = torch.autograd.grad((want_lp.sum() + want_ent.sum()), logits)
    dist = padded_heads(logits, masks)
    got_lp, got_ent = dist.log_prob(actions), dist.entropy()
    got_grads = torch.autograd.grad((got_lp.sum() + got_ent.sum()), logits)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-6, rtol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_padding_never_takes_probability() -> None:
    logits, masks, _ = _heads([2, 5, 3], batch=6, seed=0)
    probs = padded_heads(logits, masks).probs  # [B, 3, 5]
    assert torch.equal(probs[:, 0, 2:], torch.zeros(6, 3))
    assert torch.equal(probs[:, 2, 3:], torch.zeros(6, 2))
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, 3))


def test_padded_heads_need_one_mask_per_head() -> None:
    logits, masks, _ = _heads([2, 3], batch=2, seed=0)
    with pytest.raises(ValueError, match="one mask per head"):
        padded_heads(logits, masks[:1])
    with pytest.raises(ValueError, match="at least one head"):
        padded_heads([], [])
