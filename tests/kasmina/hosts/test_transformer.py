"""The causal Transformer host (kasmina/hosts/transformer.py)."""

from __future__ import annotations

import pytest
import torch

from esper.kasmina import SlotShape, TransformerHost
from esper.kasmina.hosts import transformer
from esper.kasmina.hosts.transformer import MLP_RATIO


def _host(**kwargs) -> TransformerHost:
    torch.manual_seed(0)
    return TransformerHost(
        **{"vocab_size": 11, "seq_len": 8, "d_model": 32, "n_heads": 2, **kwargs}
    )


def test_transformer_host_has_one_causal_slot_per_block_and_predicts_every_token() -> None:
    host = _host(n_layers=3)
    assert host.kind == "transformer"
    assert host.slot_ids == ("block0", "block1", "block2")
    assert all(
        s.shape == SlotShape("transformer", 32, (8,), causal=True) for s in host.iter_slots()
    )
    out = host(torch.randint(0, 11, (2, 8)))
    assert out.shape == (2, 8, 11)


@pytest.mark.parametrize("length", [1, 5, 8])
def test_shorter_sequences_up_to_seq_len_are_accepted(length: int) -> None:
    assert _host()(torch.zeros(3, length, dtype=torch.long)).shape == (3, length, 11)


def test_host_is_causal_later_tokens_do_not_change_earlier_outputs() -> None:
    host = _host().eval()
    x = torch.randint(0, 11, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 11
    with torch.no_grad():
        a, b = host(x), host(y)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("shape", [(2, 9), (2, 0), (8,), (2, 8, 1)])
def test_wrong_token_shape_raises_value_error_naming_the_limit_and_got(
    shape: tuple[int, ...],
) -> None:
    with pytest.raises(ValueError, match=r"1 <= T <= 8") as info:
        _host()(torch.zeros(shape, dtype=torch.long))
    assert f"got {list(shape)}" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_tokens_raise_value_error_naming_the_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=f"integer token ids, got dtype {dtype}"):
        _host()(torch.zeros(2, 8, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_token_dtypes_are_accepted(dtype: torch.dtype) -> None:
    assert _host()(torch.zeros(1, 4, dtype=dtype)).shape == (1, 4, 11)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vocab_size": 1}, "vocab_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"d_model": 0}, "d_model"),
        ({"n_heads": 0}, "n_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"d_model": 30, "n_heads": 4}, "d_model"),
    ],
)
def test_bad_constructor_arguments_raise_value_error_naming_the_field(
    kwargs: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=f"TransformerHost.{field}"):
        TransformerHost(**kwargs)


def test_loss_and_correct_counts_every_token() -> None:
    host = _host()
    outputs = torch.zeros(2, 3, 11)
    outputs[..., 4] = 5.0
    targets = torch.tensor([[4, 4, 0], [4, 1, 4]])
    loss, correct, n = host.loss_and_correct(outputs, targets)
    assert n == 6
    assert int(correct) == 4
    assert torch.allclose(
        loss, torch.nn.functional.cross_entropy(outputs.reshape(-1, 11), targets.reshape(-1))
    )


# ------------------------------------------------ MLP width and widening (static_equal)
def _shapes(host: TransformerHost) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in host.named_parameters()}


def test_mlp_hidden_none_is_the_network_of_before_the_argument_existed() -> None:
    d, n_layers = 32, 2
    default, explicit_none = _host(n_layers=n_layers), _host(n_layers=n_layers, mlp_hidden=None)
    ratio = _host(n_layers=n_layers, mlp_hidden=MLP_RATIO * d)
    assert _shapes(default) == _shapes(explicit_none) == _shapes(ratio)
    for i in range(n_layers):
        assert _shapes(default)[f"blocks.{i}.mlp.0.weight"] == (MLP_RATIO * d, d)
        assert _shapes(default)[f"blocks.{i}.mlp.2.weight"] == (d, MLP_RATIO * d)
    # Same names, shapes and (same seed) values: an old checkpoint loads unchanged.
    for name, tensor in default.state_dict().items():
        assert torch.equal(tensor, explicit_none.state_dict()[name]), name
    explicit_none.load_state_dict(default.state_dict())


def test_mlp_hidden_sets_the_blocks_mlp_width_and_the_host_still_runs() -> None:
    host = _host(mlp_hidden=7)
    assert _shapes(host)["blocks.0.mlp.0.weight"] == (7, 32)
    assert _shapes(host)["blocks.1.mlp.2.weight"] == (32, 7)
    assert host(torch.randint(0, 11, (2, 8))).shape == (2, 8, 11)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_a_bad_mlp_hidden_raises_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"TransformerHost\.mlp_hidden must be an int >= 1"):
        _host(mlp_hidden=bad)


def test_widening_moves_d_model_in_multiples_of_n_heads_and_mlp_hidden_by_one() -> None:
    base = {"d_model": 32, "n_heads": 2, "n_layers": 3}
    candidates = TransformerHost.widened_kwargs(base, 1.3)  # d 41.6 -> 40|42, m 166.4 -> 166|167
    assert sorted((c["d_model"], c["mlp_hidden"]) for c in candidates) == [
        (40, 166),
        (40, 167),
        (42, 166),
        (42, 167),
    ]
    assert all(c["n_heads"] == 2 and c["n_layers"] == 3 for c in candidates)
    for c in candidates:
        TransformerHost(**c)  # every candidate is a valid host


@pytest.mark.parametrize(
    "base", [{}, {"d_model": 32, "n_heads": 2}, {"d_model": 32, "n_heads": 2, "mlp_hidden": 50}]
)
def test_widening_by_one_gives_the_base_host_back(base: dict) -> None:
    candidates = TransformerHost.widened_kwargs(base, 1.0)
    if base:
        assert candidates == [base]
    else:  # the defaults, now named
        assert candidates == [{"d_model": transformer.DEFAULT_D_MODEL}]
    assert _shapes(TransformerHost(**candidates[0])) == _shapes(TransformerHost(**base))


def test_widening_leaves_mlp_hidden_out_where_it_is_the_default_of_its_d_model() -> None:
    # d 32 -> 64 and m 128 -> 256 = MLP_RATIO * 64: the default, so not named.
    assert TransformerHost.widened_kwargs({"d_model": 32, "n_heads": 2}, 2.0) == [
        {"d_model": 64, "n_heads": 2}
    ]
    # Named in the base: kept named.
    assert TransformerHost.widened_kwargs({"d_model": 32, "mlp_hidden": 128}, 2.0) == [
        {"d_model": 64, "mlp_hidden": 256}
    ]


def test_widening_refuses_a_factor_below_one() -> None:
    with pytest.raises(ValueError, match="cannot shrink"):
        TransformerHost.widened_kwargs({}, 0.9)
