"""RunningObsNormalizer: exact batch merging, masking, checkpoints, clipping, no host reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esper.host_reads import HostReadCounter
from esper.simic.normalizer import NormalizerConfig, RunningObsNormalizer

N_FEATURES = 3
TOL = 1e-9
EXAMPLES = 60


def random_batches(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    """Batches whose features differ in scale and offset, like real observations."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 100.0, 0.01], dtype=torch.float64)
    offset = torch.tensor([0.0, -50.0, 3.0], dtype=torch.float64)
    return [
        torch.randn(n, N_FEATURES, generator=g, dtype=torch.float64) * scale + offset for n in sizes
    ]


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    seed=st.integers(0, 2**31 - 1),
)
def test_merging_batches_one_by_one_equals_the_statistics_of_their_concatenation(
    sizes: list[int], seed: int
) -> None:
    batches = random_batches(seed, sizes)
    norm = RunningObsNormalizer(N_FEATURES)
    for batch in batches:
        norm.update(batch)
    everything = torch.cat(batches)
    torch.testing.assert_close(norm.mean, everything.mean(0), atol=TOL, rtol=TOL)
    torch.testing.assert_close(norm.var, everything.var(0, unbiased=False), atol=TOL, rtol=TOL)
    assert norm.count == everything.shape[0]


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    n_rows=st.integers(1, 30),
    seed=st.integers(0, 2**31 - 1),
    p_valid=st.sampled_from([0.2, 0.5, 0.9]),
)
def test_a_valid_mask_excludes_its_rows_even_when_they_hold_nan(
    n_rows: int, seed: int, p_valid: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    first, second = random_batches(seed, [7, n_rows])
    valid = torch.rand(n_rows, generator=g) < p_valid
    second[~valid] = float("nan")
    masked = RunningObsNormalizer(N_FEATURES)
    masked.update(first)
    masked.update(second, valid)
    selected = RunningObsNormalizer(N_FEATURES)
    selected.update(torch.cat([first, second[valid]]))
    for name in ("mean", "var", "count"):
        torch.testing.assert_close(
            getattr(masked, name), getattr(selected, name), atol=TOL, rtol=TOL
        )


def test_a_rollout_shaped_batch_with_a_matching_mask_is_accepted() -> None:
    obs = torch.randn(4, 25, N_FEATURES)  # [E, T, D]
    valid = torch.ones(4, 25, dtype=torch.bool)
    valid[2, 10:] = False
    norm = RunningObsNormalizer(N_FEATURES)
    norm.update(obs, valid)
    assert norm.count == 4 * 25 - 15
    torch.testing.assert_close(norm.mean, obs[valid].double().mean(0))


def test_an_all_invalid_batch_changes_nothing_before_or_after_data() -> None:
    norm = RunningObsNormalizer(N_FEATURES)
    nothing = torch.zeros(5, dtype=torch.bool)
    norm.update(torch.randn(5, N_FEATURES), nothing)
    assert norm.count == 0
    torch.testing.assert_close(norm.var, torch.ones(N_FEATURES, dtype=torch.float64))
    norm.update(random_batches(1, [10])[0])
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    norm.update(torch.randn(5, N_FEATURES), nothing)
    for k, v in norm.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)


def test_statistics_round_trip_through_state_dict() -> None:
    trained = RunningObsNormalizer(N_FEATURES)
    trained.update(random_batches(2, [50])[0])
    restored = RunningObsNormalizer(N_FEATURES)
    restored.load_state_dict(trained.state_dict())
    assert set(trained.state_dict()) == {"mean", "var", "count"}
    probe = torch.randn(8, N_FEATURES)
    torch.testing.assert_close(restored(probe), trained(probe), atol=0, rtol=0)
    assert restored.count == 50


def test_output_is_standardised_and_clipped_to_the_configured_bound() -> None:
    clip = 2.0
    norm = RunningObsNormalizer(1, NormalizerConfig(clip=clip))
    norm.update(torch.tensor([[-1.0], [1.0]]))  # mean 0, population var 1
    out = norm(torch.tensor([[0.5], [-1.5], [100.0], [-100.0]]))
    expected = torch.tensor([[0.5], [-1.5], [clip], [-clip]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    assert out.dtype == torch.float32


def test_a_zero_variance_feature_stays_finite() -> None:
    norm = RunningObsNormalizer(2)
    constant = torch.tensor([[3.0, 1.0], [3.0, 2.0], [3.0, 3.0]])
    norm.update(constant)
    assert norm.var[0] == 0
    out = norm(torch.tensor([[3.0, 2.0], [3.5, 2.0]]))
    assert torch.isfinite(out).all()
    assert out[0, 0] == 0  # the value seen maps to the centre
    assert out[1, 0] == norm.config.clip  # anything else is bounded, not infinite


def test_an_unfitted_normaliser_passes_values_through_up_to_the_clip() -> None:
    norm = RunningObsNormalizer(2)
    x = torch.tensor([[0.25, -4.0], [50.0, 0.0]])
    expected = torch.tensor([[0.25, -4.0], [norm.config.clip, 0.0]])
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=0)


def test_update_and_normalize_read_nothing_on_the_host() -> None:
    norm = RunningObsNormalizer(N_FEATURES)
    obs = torch.randn(4, 25, N_FEATURES)
    valid = torch.rand(4, 25) < 0.8
    with HostReadCounter() as counter:
        norm.update(obs, valid)
        norm.update(obs)
        norm(obs)
    assert counter.count == 0, counter.report()
    assert norm.count > 0


def test_update_builds_no_graph_from_observations_that_require_grad() -> None:
    norm = RunningObsNormalizer(N_FEATURES)
    norm.update(torch.randn(6, N_FEATURES, requires_grad=True))
    assert not norm.mean.requires_grad and not norm.var.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eps": 0.0}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"clip": -1.0}, "clip"),
        ({"clip": float("inf")}, "clip"),
    ],
)
def test_bad_config_values_are_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(
        ValueError, match=rf"NormalizerConfig\.{field}: must be a finite number > 0"
    ):
        NormalizerConfig(**kwargs)


def test_wrong_feature_count_and_bad_masks_are_rejected() -> None:
    norm = RunningObsNormalizer(N_FEATURES)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 3\]"):
        norm.update(torch.randn(5, N_FEATURES + 1))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 3\]"):
        norm(torch.randn(5, 2))
    with pytest.raises(ValueError, match="valid must be a bool tensor of shape"):
        norm.update(torch.randn(5, N_FEATURES), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid must be a bool tensor of shape"):
        norm.update(torch.randn(5, N_FEATURES), torch.ones(5))
    with pytest.raises(ValueError, match="n_features must be an int >= 1"):
        RunningObsNormalizer(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_matches_cpu_and_reads_nothing_on_the_host() -> None:
    obs = torch.randn(4, 25, N_FEATURES) * 5 + 2
    valid = torch.rand(4, 25) < 0.8
    on_cpu = RunningObsNormalizer(N_FEATURES)
    on_cpu.update(obs, valid)
    on_gpu = RunningObsNormalizer(N_FEATURES).cuda()
    with HostReadCounter() as counter:
        on_gpu.update(obs.cuda(), valid.cuda())
        out = on_gpu(obs.cuda())
    assert counter.count == 0, counter.report()
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), on_cpu(obs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_gpu.state_dict()["var"].cpu(), on_cpu.var, atol=1e-9, rtol=1e-9)
