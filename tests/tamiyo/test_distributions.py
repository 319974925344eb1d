"""MaskedCategorical: legal samples, finite entropy, exact agreement with a plain categorical."""

from __future__ import annotations

import math

import pytest
import torch

from esper.host_reads import HostReadCounter
from esper.tamiyo.distributions import MaskedCategorical, ensure_any_legal, masked_logits

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
