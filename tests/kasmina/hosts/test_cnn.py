"""The convolutional host (kasmina/hosts/cnn.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GateSignals, GrowingHost, OptimConfig, SlotShape
from esper.kasmina.hosts import cnn
from esper.kasmina.hosts.cnn import max_pool_2x2
from tests.kasmina.factories import FAST


@pytest.mark.parametrize(
    ("input_shape", "slot_shapes"),
    [
        ((1, 8, 8), [(16, (8, 8)), (32, (4, 4)), (64, (2, 2))]),
        ((3, 32, 32), [(16, (32, 32)), (32, (16, 16)), (64, (8, 8))]),
    ],
    ids=["digits", "cifar10"],
)
def test_cnn_host_builds_and_runs_on_digits_and_cifar_shapes(
    input_shape: tuple[int, int, int], slot_shapes: list[tuple[int, tuple[int, int]]]
) -> None:
    torch.manual_seed(0)
    host = CNNHost(input_shape)
    assert host.kind == "cnn"
    assert host.slot_ids == ("stage0", "stage1", "stage2")
    widths = [input_shape[0], *(c for c, _ in slot_shapes[:-1])]
    consumers = [(c, 9) for c, _ in slot_shapes[1:]] + [(10, 1)]
    assert [s.shape for s in host.iter_slots()] == [
        SlotShape(
            "cnn", c, hw, producer_in=c_in, producer_layers=2, consumer_out=out, consumer_area=area
        )
        for (c, hw), c_in, (out, area) in zip(slot_shapes, widths, consumers, strict=True)
    ]
    x = torch.randn(3, *input_shape)
    out = host(x)
    assert out.shape == (3, 10)
    assert bool(torch.isfinite(out).all())


def test_pooling_stops_once_the_feature_map_is_one_pixel() -> None:
    host = CNNHost((1, 2, 2), channels=(4, 4, 4))
    assert host.pools == [True, False, False]
    assert [s.shape.spatial for s in host.iter_slots()] == [(2, 2), (1, 1), (1, 1)]
    assert host(torch.randn(2, 1, 2, 2)).shape == (2, 10)


@pytest.mark.parametrize(
    ("built_for", "given"),
    [
        ((1, 8, 8), (2, 3, 32, 32)),
        ((3, 32, 32), (2, 1, 8, 8)),
        ((1, 8, 8), (2, 1, 8, 9)),
        ((1, 8, 8), (1, 8, 8)),
        ((1, 8, 8), (2, 1, 1, 8, 8)),
    ],
)
def test_wrong_image_shape_raises_value_error_naming_expected_and_got(
    built_for: tuple[int, ...], given: tuple[int, ...]
) -> None:
    host = CNNHost(built_for)
    expected = f"[batch, {', '.join(map(str, built_for))}]"
    with pytest.raises(ValueError, match=r"CNNHost expects images shaped") as info:
        host(torch.zeros(given))
    assert expected in str(info.value)
    assert f"got {list(given)}" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool])
def test_non_float_images_raise_value_error_naming_the_dtype(dtype: torch.dtype) -> None:
    host = CNNHost((1, 8, 8))
    with pytest.raises(ValueError, match=f"floating-point images, got dtype {dtype}"):
        host(torch.zeros(2, 1, 8, 8, dtype=dtype))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_shape": (8, 8)}, "input_shape"),
        ({"input_shape": (1, 0, 8)}, "input_shape"),
        ({"n_classes": 1}, "n_classes"),
        ({"channels": ()}, "channels"),
        ({"channels": (16, 0)}, "channels"),
        ({"convs_per_stage": 0}, "convs_per_stage"),
        ({"convs_per_stage": 1.5}, "convs_per_stage"),
    ],
)
def test_bad_constructor_arguments_raise_value_error_naming_the_field(
    kwargs: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=f"CNNHost.{field}"):
        CNNHost(**kwargs)


def test_loss_and_correct_counts_predictions_per_sample() -> None:
    host = CNNHost((1, 8, 8), n_classes=3)
    outputs = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    targets = torch.tensor([0, 1, 0, 0])
    loss, correct, n = host.loss_and_correct(outputs, targets)
    assert n == 4
    assert int(correct) == 3
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(outputs, targets))


def test_one_conv_per_stage_is_the_predecessors_host() -> None:
    """esper-lite's host: per stage one conv3x3 without bias, BN, ReLU, 2x2 max-pool;
    global pooling and a linear head. 6 418 parameters on 3x32x32 and 10 classes."""
    host = CNNHost((3, 32, 32), 10, channels=(8, 16, 32), convs_per_stage=1)
    assert sum(p.numel() for p in host.parameters()) == 6418
    for stage in host.stages:
        kinds = [type(layer) for layer in stage.body]
        assert kinds == [torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.ReLU]
        assert stage.body[0].bias is None and stage.body[0].kernel_size == (3, 3)
    assert host.pools == [True, True, True]
    assert host(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_predecessors_host_grows_in_every_slot_like_any_cnn_host() -> None:
    torch.manual_seed(0)
    host = CNNHost((3, 32, 32), 10, channels=(8, 16, 32), convs_per_stage=1)
    grown = GrowingHost(host, OptimConfig())
    before = sum(p.numel() for p in host.parameters())
    for slot_id in host.slot_ids:
        grown.germinate(slot_id, "conv_light", BlendMode.LINEAR)
    assert sum(p.numel() for p in host.parameters()) > before
    out = host(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and bool(torch.isfinite(out).all())


def _pool_inputs() -> list[torch.Tensor]:
    """Random maps, maps full of ties (ReLU zeros, quarter steps), odd sizes, NaN and -inf."""
    g = torch.Generator().manual_seed(0)
    tied = (torch.randn(4, 3, 8, 8, generator=g).relu() * 4).round() / 4
    special = torch.randn(2, 2, 4, 4, generator=g)
    special[0, 0, 0, 1] = float("nan")
    special[1, 1, :2, :2] = float("-inf")
    return [
        torch.randn(5, 8, 16, 16, generator=g),
        tied,
        torch.randn(3, 4, 7, 9, generator=g),
        special,
    ]


@pytest.mark.parametrize("case", range(4), ids=["random", "ties", "odd", "nan_inf"])
def test_max_pool_without_gradients_equals_torch_max_pool(case: int) -> None:
    x = _pool_inputs()[case]
    with torch.no_grad():
        fast = max_pool_2x2(x)
    expected = F.max_pool2d(x, 2)
    assert fast.shape == expected.shape
    assert torch.equal(fast.isnan(), expected.isnan())
    assert torch.equal(fast.nan_to_num(), expected.nan_to_num())


def test_max_pool_with_gradients_routes_them_as_torch_max_pool_does() -> None:
    x = _pool_inputs()[1]
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(F.max_pool2d(x, 2).shape)
    max_pool_2x2(mine).backward(grad)
    F.max_pool2d(theirs, 2).backward(grad)
    assert torch.equal(mine.grad, theirs.grad)  # ties: the first maximum of a window


def test_a_validation_forward_equals_the_forward_with_torch_max_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    host = CNNHost((3, 32, 32), 10, channels=(8, 16, 32), convs_per_stage=1).eval()
    x = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        fast = host(x)
        monkeypatch.setattr(cnn, "max_pool_2x2", lambda h: F.max_pool2d(h, 2))
        assert torch.equal(fast, host(x))


def _slot_inputs(host: CNNHost, x: torch.Tensor) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    hooks = [
        host.slot(s).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        for s in host.slot_ids
    ]
    host(x)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    ("channels", "channels_last"), [((8, 16, 32), True), ((2, 4, 8), False)], ids=["8up", "2"]
)
def test_the_cpu_runs_hosts_of_eight_channels_up_in_channels_last_layout(
    channels: tuple[int, ...], channels_last: bool
) -> None:
    """NHWC is faster on the CPU from 8 channels up, slower below (cnn.channels_last_on_cpu)."""
    host = CNNHost((3, 32, 32), 10, channels=channels, convs_per_stage=1)
    maps = _slot_inputs(host, torch.randn(2, 3, 32, 32))
    layouts = [m.is_contiguous(memory_format=torch.channels_last) for m in maps]
    assert layouts == [channels_last] * len(channels)
    assert all(m.is_contiguous() != channels_last for m in maps)


def test_channels_last_gives_the_nchw_network_s_outputs_and_gradients() -> None:
    """Same network, same figures up to float rounding, seeds (GroupNorm ones too) included."""
    torch.manual_seed(0)
    nhwc = CNNHost((3, 32, 32), 10, channels=(8, 16, 32), convs_per_stage=1, lifecycle=FAST)
    grown = GrowingHost(nhwc, OptimConfig())
    for slot_id, blueprint in zip(
        nhwc.slot_ids, ["conv_light", "conv_heavy", "conv_wide"], strict=True
    ):
        grown.germinate(slot_id, blueprint, BlendMode.LINEAR)
        for _ in range(2):  # GERMINATED -> TRAINING -> BLENDING: the seed's output counts
            assert grown.advance(slot_id, GateSignals(grads_finite=True, contribution=1.0))
        torch.nn.init.normal_(list(nhwc.slot(slot_id).seed_parameters())[-1], std=0.1)
    grown.end_epoch()
    assert all(
        nhwc.slot(s).stage is SeedStage.BLENDING and nhwc.slot(s).alpha > 0 for s in nhwc.slot_ids
    )
    nchw = copy.deepcopy(nhwc)
    nchw.channels_last = False
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    outputs = []
    for host in (nhwc, nchw):
        out = host(x)
        F.cross_entropy(out, y).backward()
        outputs.append(out)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)
    for a, b in zip(nhwc.parameters(), nchw.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


# ------------------------------------------------------- widening (static_equal)
def test_mapped_runs_the_stage_relus_out_of_place_and_gives_them_back_even_on_error() -> None:
    host = CNNHost(channels=(8, 16), convs_per_stage=2)
    relus = [m for m in host.modules() if isinstance(m, torch.nn.ReLU)]
    assert len(relus) == 4 and all(relu.inplace for relu in relus)
    with host.mapped():
        assert not any(relu.inplace for relu in relus)
    assert all(relu.inplace for relu in relus)
    with pytest.raises(RuntimeError, match="inside"), host.mapped():
        raise RuntimeError("inside")
    assert all(relu.inplace for relu in relus)


def test_widening_offers_every_floor_and_ceiling_of_each_stage() -> None:
    candidates = CNNHost.widened_kwargs({"channels": [2, 4, 8], "convs_per_stage": 1}, 1.3)
    # 2.6 -> 2|3, 5.2 -> 5|6, 10.4 -> 10|11
    assert sorted(tuple(c["channels"]) for c in candidates) == [
        (a, b, c) for a in (2, 3) for b in (5, 6) for c in (10, 11)
    ]
    assert all(c["convs_per_stage"] == 1 for c in candidates)


def test_widening_by_one_gives_the_base_arguments_and_defaults_to_default_channels() -> None:
    base = {"channels": [2, 4, 8], "convs_per_stage": 1}
    assert CNNHost.widened_kwargs(base, 1.0) == [base]
    assert CNNHost.widened_kwargs({}, 1) == [{"channels": list(cnn.DEFAULT_CHANNELS)}]
    assert CNNHost.widened_kwargs({}, 2.0) == [{"channels": [2 * c for c in cnn.DEFAULT_CHANNELS]}]


@pytest.mark.parametrize("factor", [0.5, 0.0, float("nan"), float("inf"), True])
def test_widening_refuses_a_factor_that_is_not_a_finite_number_of_at_least_one(
    factor: float,
) -> None:
    with pytest.raises(ValueError, match="widening factor must be"):
        CNNHost.widened_kwargs({}, factor)
