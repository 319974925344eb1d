"""Next-token data: the synthetic Markov chain and character-level text files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from esper.tolaria.data import TokenSequenceDataModule
from esper.tolaria.data.tokens import (
    DEFAULT_SEQ_LEN,
    DEFAULT_VOCAB_SIZE,
    min_text_length,
)

BATCH = 8


def test_synthetic_shapes_and_shifted_targets() -> None:
    dm = TokenSequenceDataModule(batch_size=BATCH)
    assert dm.task == "language_model"
    assert dm.input_shape == (DEFAULT_SEQ_LEN,) and dm.n_classes == DEFAULT_VOCAB_SIZE
    x, y = next(iter(dm.host_train_dataloader()))
    assert x.shape == y.shape == (BATCH, DEFAULT_SEQ_LEN)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert int(x.min()) >= 0 and int(x.max()) < DEFAULT_VOCAB_SIZE


def test_synthetic_is_deterministic_and_low_entropy() -> None:
    a = TokenSequenceDataModule(
        vocab_size=12, seq_len=10, n_train=64, n_val=16, branching=2, batch_size=BATCH
    )
    b = TokenSequenceDataModule(
        vocab_size=12, seq_len=10, n_train=64, n_val=16, branching=2, batch_size=BATCH, seed=5
    )
    assert torch.equal(a.train_dataset.tensors[0], b.train_dataset.tensors[0])
    assert torch.equal(a.val_dataset.tensors[1], b.val_dataset.tensors[1])
    x, y = a.train_dataset.tensors
    # Learnable: each token is followed by at most `branching` distinct tokens.
    pairs = set(zip(x.flatten().tolist(), y.flatten().tolist(), strict=True))
    for token in range(12):
        assert len({nxt for cur, nxt in pairs if cur == token}) <= 2


def test_text_mode_vocab_windows_and_split(tmp_path: Path) -> None:
    text = "hello world, héllo again! " * 20  # 520 characters, one non-ASCII
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    seq_len = 7
    dm = TokenSequenceDataModule(
        text_path=path, seq_len=seq_len, val_fraction=0.25, batch_size=BATCH
    )
    assert dm.vocab == tuple(sorted(set(text)))
    assert dm.n_classes == len(dm.vocab) == dm.vocab_size
    x, y = dm.train_dataset.tensors
    assert x.shape[1] == seq_len and torch.equal(y[:, :-1], x[:, 1:])
    # Stride seq_len: consecutive windows chain, and decoding gives back the text prefix.
    assert torch.equal(x[1:, 0], y[:-1, -1])
    n_val_chars = len(text) // 4
    n_train_chars = len(text) - n_val_chars
    assert len(x) == (n_train_chars - 1) // seq_len
    # The last train target is the last character the train windows reach.
    assert dm.decode(y[-1, -1:]) == text[len(x) * seq_len]
    assert dm.decode(x[0]) == text[:seq_len]
    vx, _ = dm.val_dataset.tensors
    assert dm.decode(vx[0]) == text[n_train_chars : n_train_chars + seq_len]
    assert torch.equal(dm.encode("hello"), x[0, :5])


def test_text_mode_errors(tmp_path: Path) -> None:
    missing = tmp_path / "absent.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        TokenSequenceDataModule(text_path=missing)
    short = tmp_path / "short.txt"
    seq_len, fraction = 4, 0.5
    minimum = min_text_length(seq_len, fraction)
    assert minimum == 2 * (seq_len + 1)
    short.write_text("ab" * (minimum // 2 - 1) + "a", encoding="utf-8")
    with pytest.raises(ValueError, match=f"at least {minimum} characters"):
        TokenSequenceDataModule(text_path=short, seq_len=seq_len, val_fraction=fraction)
    short.write_text("ab" * (minimum // 2), encoding="utf-8")
    dm = TokenSequenceDataModule(
        text_path=short, seq_len=seq_len, val_fraction=fraction, batch_size=1
    )
    assert dm.train_size == dm.val_size == 1
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00" * 100)
    with pytest.raises(ValueError, match="UTF-8"):
        TokenSequenceDataModule(text_path=binary)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenSequenceDataModule(text_path=short, vocab_size=8)


@pytest.mark.parametrize("fraction", [0.001, 0.1, 0.37, 0.5, 0.9, 0.999])
def test_min_text_length_is_exact(fraction: float) -> None:
    seq_len = 5
    window = seq_len + 1
    minimum = min_text_length(seq_len, fraction)

    def fits(n: int) -> bool:
        n_val = int(n * fraction)
        return n_val >= window and n - n_val >= window

    assert fits(minimum) and not fits(minimum - 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"n_train": 0}, "n_train"),
        ({"branching": 17}, "branching"),
        ({"val_fraction": 0.2}, "val_fraction"),
        ({"data_seed": 1.0}, "data_seed"),
    ],
)
def test_bad_args_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TokenSequenceDataModule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [1.5, 0.0, float("nan"), True])
def test_bad_val_fraction_in_text_mode(tmp_path: Path, fraction: float) -> None:
    path = tmp_path / "t.txt"
    path.write_text("abc" * 100, encoding="utf-8")
    with pytest.raises(ValueError, match="val_fraction"):
        TokenSequenceDataModule(text_path=path, val_fraction=fraction)
