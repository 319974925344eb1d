"""The causal Transformer host (kasmina/hosts/transformer.py)."""

from __future__ import annotations

import pytest
import torch

from esper.kasmina import SlotShape, TransformerHost


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
