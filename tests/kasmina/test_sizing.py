"""Sizing a plain host to a parameter count (kasmina/sizing.py): the static_equal control."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from esper.kasmina import CNNHost, HostModel, LifecycleConfig, TransformerHost
from esper.kasmina.sizing import DEFAULT_TOLERANCE, count_parameters, equal_size_host_kwargs

CNN_SHAPE, CNN_CLASSES, CNN_BASE = (1, 8, 8), 10, {"channels": [2, 4, 8]}
TOKENS_SHAPE, VOCAB, TRANSFORMER_BASE = (32,), 16, {}
#: Targets as multiples of the base host's own count, across the range a grower reaches.
MULTIPLES = (1.5, 2.0, 3.7, 8.0, 20.0)

CASES = [
    pytest.param(CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, id="cnn"),
    pytest.param(TransformerHost, TRANSFORMER_BASE, TOKENS_SHAPE, VOCAB, id="transformer"),
]


def built_count(host_cls: type[HostModel], shape: tuple[int, ...], n: int, **kwargs: Any) -> int:
    return count_parameters(host_cls.from_data(shape, n, **kwargs))


@pytest.mark.parametrize(("host_cls", "base", "shape", "n_classes"), CASES)
@pytest.mark.parametrize("multiple", MULTIPLES)
def test_targets_across_the_range_land_within_tolerance_with_the_built_count(
    host_cls: type[HostModel],
    base: dict[str, Any],
    shape: tuple[int, ...],
    n_classes: int,
    multiple: float,
) -> None:
    target = multiple * built_count(host_cls, shape, n_classes, **base)
    kwargs, count = equal_size_host_kwargs(host_cls, base, shape, n_classes, target)
    assert abs(count - target) <= DEFAULT_TOLERANCE * target
    assert count == built_count(host_cls, shape, n_classes, **kwargs)


@pytest.mark.parametrize("target", [5000, 7000, 20000, 50000])
def test_the_cnn_host_of_the_controls_widens_every_stage_to_a_few_thousand_parameters(
    target: int,
) -> None:
    kwargs, count = equal_size_host_kwargs(CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, target)
    assert abs(count - target) <= DEFAULT_TOLERANCE * target
    assert set(kwargs) == {"channels"}
    assert all(w >= b for w, b in zip(kwargs["channels"], CNN_BASE["channels"], strict=True))


@pytest.mark.parametrize(("host_cls", "base", "shape", "n_classes"), CASES)
def test_the_base_count_gives_the_base_arguments_back(
    host_cls: type[HostModel], base: dict[str, Any], shape: tuple[int, ...], n_classes: int
) -> None:
    count = built_count(host_cls, shape, n_classes, **base)
    kwargs, got = equal_size_host_kwargs(host_cls, base, shape, n_classes, count)
    assert got == count
    assert count_parameters(host_cls.from_data(shape, n_classes, **kwargs)) == count


def test_other_arguments_pass_through_unchanged() -> None:
    lifecycle = LifecycleConfig(min_training_epochs=1)
    base = {"channels": [2, 4, 8], "convs_per_stage": 1, "lifecycle": lifecycle}
    target = 4 * built_count(CNNHost, CNN_SHAPE, CNN_CLASSES, **base)
    kwargs, _ = equal_size_host_kwargs(CNNHost, base, CNN_SHAPE, CNN_CLASSES, target)
    assert kwargs["convs_per_stage"] == 1
    assert kwargs["lifecycle"] is lifecycle


@pytest.mark.parametrize(("host_cls", "base", "shape", "n_classes"), CASES)
def test_a_target_below_the_base_count_raises_saying_a_host_cannot_shrink(
    host_cls: type[HostModel], base: dict[str, Any], shape: tuple[int, ...], n_classes: int
) -> None:
    count = built_count(host_cls, shape, n_classes, **base)
    with pytest.raises(ValueError, match="cannot shrink") as info:
        equal_size_host_kwargs(host_cls, base, shape, n_classes, count / 2)
    assert f"{count:,}" in str(info.value)


def test_a_target_just_below_the_base_count_within_tolerance_is_the_base_host() -> None:
    count = built_count(CNNHost, CNN_SHAPE, CNN_CLASSES, **CNN_BASE)
    kwargs, got = equal_size_host_kwargs(
        CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, count * (1 - DEFAULT_TOLERANCE / 2)
    )
    assert (kwargs, got) == (CNN_BASE, count)


def test_a_target_between_the_family_s_steps_raises_naming_what_was_reached() -> None:
    # One stage of one channel: 42 parameters, the next width (2 channels) 92.
    base = {"channels": [1]}
    count = built_count(CNNHost, CNN_SHAPE, CNN_CLASSES, **base)
    assert (count, built_count(CNNHost, CNN_SHAPE, CNN_CLASSES, channels=[2])) == (42, 92)
    with pytest.raises(ValueError, match=r"to 55 parameters within 5%.* has 42 .*too coarse"):
        equal_size_host_kwargs(CNNHost, base, CNN_SHAPE, CNN_CLASSES, 1.3 * count)


@pytest.mark.parametrize(
    ("target", "tolerance", "field"),
    [(0, 0.05, "target_params"), (float("nan"), 0.05, "target_params"), (1e4, 0.0, "tolerance")],
)
def test_bad_targets_and_tolerances_raise_naming_them(
    target: float, tolerance: float, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        equal_size_host_kwargs(CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, target, tolerance)


def test_a_target_beyond_the_widest_search_raises_naming_what_was_reached() -> None:
    with pytest.raises(ValueError, match=r"widening it 64 times reached only [\d,]+ .*wider host"):
        equal_size_host_kwargs(CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, 1e9)


def test_numpy_numbers_are_targets_too() -> None:
    _, count = equal_size_host_kwargs(
        CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, np.int64(7000), np.float64(DEFAULT_TOLERANCE)
    )
    assert abs(count - 7000) <= DEFAULT_TOLERANCE * 7000


def test_sizing_leaves_torch_s_random_generator_where_it_was() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    equal_size_host_kwargs(CNNHost, CNN_BASE, CNN_SHAPE, CNN_CLASSES, 7000)
    assert torch.equal(torch.rand(3), expected)


class _Unwidenable(HostModel):
    """A host family without the widening hook."""

    kind = "unwidenable"

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.slots = torch.nn.ModuleDict()
        self.body = torch.nn.Linear(width, width)

    @classmethod
    def from_data(cls, input_shape, n_classes, lifecycle=None, **kwargs: Any) -> _Unwidenable:  # type: ignore[no-untyped-def]
        return cls(**kwargs)

    def check_input(self, x: Tensor) -> None:
        pass

    def loss_and_correct(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        raise NotImplementedError


def test_a_host_without_the_hook_says_to_implement_it() -> None:
    with pytest.raises(
        NotImplementedError, match=r"_Unwidenable.*implement widened_kwargs"
    ) as info:
        equal_size_host_kwargs(_Unwidenable, {}, (4,), 2, 1000)
    assert "static_equal" in str(info.value)
