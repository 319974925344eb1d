"""Next-token data: the synthetic Markov chain and character-level text files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from esper.tolaria.data import DataSplits, TokenSequenceDataModule
from esper.tolaria.data.tokens import (
    DEFAULT_SEQ_LEN,
    DEFAULT_TOKEN_N_TEST,
    DEFAULT_VOCAB_SIZE,
    min_text_length,
)

BATCH = 8
SPLITS = DataSplits._fields
CHAIN = {"vocab_size": 12, "seq_len": 10, "n_train": 64, "n_val": 16, "branching": 2}


def _tensors(dm: TokenSequenceDataModule, split: str) -> tuple[torch.Tensor, ...]:
    return getattr(dm, f"{split}_dataset").tensors


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


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
    a = TokenSequenceDataModule(**CHAIN, batch_size=BATCH)
    b = TokenSequenceDataModule(**CHAIN, batch_size=BATCH, seed=5)
    for split in SPLITS:
        for ta, tb in zip(_tensors(a, split), _tensors(b, split), strict=True):
            assert torch.equal(ta, tb)
    c = TokenSequenceDataModule(**CHAIN, batch_size=BATCH, data_seed=1)
    assert not torch.equal(a.test_dataset.tensors[0], c.test_dataset.tensors[0])
    x, y = a.train_dataset.tensors
    # Learnable: each token is followed by at most `branching` distinct tokens.
    pairs = set(zip(x.flatten().tolist(), y.flatten().tolist(), strict=True))
    for token in range(12):
        assert len({nxt for cur, nxt in pairs if cur == token}) <= 2


def test_synthetic_splits_are_sized_as_configured() -> None:
    dm = TokenSequenceDataModule(**CHAIN, n_test=24, batch_size=BATCH)
    assert (dm.train_size, dm.val_size, dm.test_size) == (64, 16, 24)
    assert dm.test_dataset.tensors[0].shape == (24, 10)
    assert TokenSequenceDataModule(batch_size=BATCH).test_size == DEFAULT_TOKEN_N_TEST


def test_synthetic_test_sequences_are_drawn_after_and_apart_from_validation() -> None:
    """More or fewer test sequences leave train and val as they were; test is new draws."""
    few = TokenSequenceDataModule(**CHAIN, n_test=4, batch_size=BATCH)
    many = TokenSequenceDataModule(**CHAIN, n_test=200, batch_size=BATCH)
    for split in ("train", "val"):
        for ta, tb in zip(_tensors(few, split), _tensors(many, split), strict=True):
            assert torch.equal(ta, tb)
    val_x, test_x = few.val_dataset.tensors[0], few.test_dataset.tensors[0]
    assert not torch.equal(test_x, val_x[: len(test_x)])
    # Same chain: the test sequences still follow its edges.
    successors = few.transition_successors
    assert successors is not None
    tx, ty = few.test_dataset.tensors
    assert (successors[tx] == ty.unsqueeze(-1)).any(-1).all()


def test_synthetic_train_and_val_are_what_they_were_before_the_test_split() -> None:
    """Replaying the generator as before test existed (chain, train, val) gives the same."""
    dm = TokenSequenceDataModule(**CHAIN, batch_size=BATCH)
    dm.setup()
    generator = torch.Generator().manual_seed(dm.data_seed)
    vocab, k = CHAIN["vocab_size"], CHAIN["branching"]
    torch.rand(vocab, vocab, generator=generator)  # the successors
    torch.rand(vocab, k, generator=generator)  # their probabilities
    assert dm.transition_successors is not None and dm.transition_probs is not None
    for split in ("train", "val"):
        replay = dm._sample_chain(
            CHAIN[f"n_{split}"], dm.transition_successors, dm.transition_probs, generator
        )
        for ta, tb in zip(replay.tensors, _tensors(dm, split), strict=True):
            assert torch.equal(ta, tb)


def test_synthetic_test_loader_yields_the_whole_test_split_in_order() -> None:
    dm = TokenSequenceDataModule(**CHAIN, n_test=20, batch_size=BATCH, val_batch_size=8)
    batches = list(dm.host_test_dataloader())
    assert [len(x) for x, _ in batches] == [8, 8, 4]
    assert torch.equal(torch.cat([x for x, _ in batches]), dm.test_dataset.tensors[0])
    assert torch.equal(torch.cat([y for _, y in batches]), dm.test_dataset.tensors[1])


def test_text_mode_vocab_windows_and_split(tmp_path: Path) -> None:
    text = "hello world, héllo again! " * 20  # 520 characters, one non-ASCII
    path = _write(tmp_path, text)
    seq_len = 7
    dm = TokenSequenceDataModule(
        text_path=path, seq_len=seq_len, val_fraction=0.25, test_fraction=0.1, batch_size=BATCH
    )
    assert dm.vocab == tuple(sorted(set(text)))
    assert dm.n_classes == len(dm.vocab) == dm.vocab_size
    x, y = dm.train_dataset.tensors
    assert x.shape[1] == seq_len and torch.equal(y[:, :-1], x[:, 1:])
    # Stride seq_len: consecutive windows chain, and decoding gives back the text prefix.
    assert torch.equal(x[1:, 0], y[:-1, -1])
    n_val_chars = len(text) // 4
    n_test_chars = len(text) // 10
    n_train_chars = len(text) - n_val_chars - n_test_chars
    assert len(x) == (n_train_chars - 1) // seq_len
    # The last train target is the last character the train windows reach.
    assert dm.decode(y[-1, -1:]) == text[len(x) * seq_len]
    assert dm.decode(x[0]) == text[:seq_len]
    vx, _ = dm.val_dataset.tensors
    assert dm.decode(vx[0]) == text[n_train_chars : n_train_chars + seq_len]
    assert len(vx) == (n_val_chars - 1) // seq_len
    assert torch.equal(dm.encode("hello"), x[0, :5])


def test_text_mode_splits_by_position_train_then_val_then_test(tmp_path: Path) -> None:
    """Each part's windows decode back to its own stretch of the text, in order."""
    text = "".join(chr(ord("a") + i % 26) + chr(ord("A") + i // 26 % 26) for i in range(300))
    seq_len = 5
    dm = TokenSequenceDataModule(
        text_path=_write(tmp_path, text),
        seq_len=seq_len,
        val_fraction=0.2,
        test_fraction=0.3,
        batch_size=BATCH,
    )
    n_val, n_test = len(text) * 2 // 10, len(text) * 3 // 10
    n_train = len(text) - n_val - n_test
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val)}
    bounds["test"] = (n_train + n_val, len(text))
    for split, (start, end) in bounds.items():
        x, y = _tensors(dm, split)
        assert len(x) == (end - start - 1) // seq_len
        decoded = dm.decode(x) + dm.decode(y[-1, -1:])  # stride seq_len: windows chain
        assert decoded == text[start : start + len(x) * seq_len + 1]
    tests = list(dm.host_test_dataloader())
    assert torch.equal(torch.cat([x for x, _ in tests]), dm.test_dataset.tensors[0])


def test_text_mode_test_split_is_the_text_s_tail_whatever_the_seed(tmp_path: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 10
    path = _write(tmp_path, text)
    a = TokenSequenceDataModule(text_path=path, seq_len=6, batch_size=BATCH, seed=0)
    b = TokenSequenceDataModule(text_path=path, seq_len=6, batch_size=BATCH, seed=9)
    assert a.test_fraction == a.val_fraction == 0.1  # the defaults
    for split in SPLITS:
        for ta, tb in zip(_tensors(a, split), _tensors(b, split), strict=True):
            assert torch.equal(ta, tb)
    n_test = len(text) // 10
    assert a.decode(a.test_dataset.tensors[0][0]) == text[len(text) - n_test :][:6]


def test_text_mode_errors(tmp_path: Path) -> None:
    missing = tmp_path / "absent.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        TokenSequenceDataModule(text_path=missing)
    short = tmp_path / "short.txt"
    seq_len, fractions = 4, {"val_fraction": 0.3, "test_fraction": 0.3}
    minimum = min_text_length(seq_len, fractions["val_fraction"], fractions["test_fraction"])
    # 17 characters: 5 validation (floor 5.1), 5 test and 7 train, one window each.
    assert minimum == 17
    short.write_text(("ab" * minimum)[: minimum - 1], encoding="utf-8")
    with pytest.raises(ValueError, match=f"at least {minimum} characters") as info:
        TokenSequenceDataModule(text_path=short, seq_len=seq_len, **fractions)
    assert "split 8 train / 4 validation / 4 test" in str(info.value)
    short.write_text(("ab" * minimum)[:minimum], encoding="utf-8")
    dm = TokenSequenceDataModule(text_path=short, seq_len=seq_len, batch_size=1, **fractions)
    assert dm.train_size == dm.val_size == dm.test_size == 1
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00" * 100)
    with pytest.raises(ValueError, match="UTF-8"):
        TokenSequenceDataModule(text_path=binary)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenSequenceDataModule(text_path=short, vocab_size=8)


@pytest.mark.parametrize(
    ("val_fraction", "test_fraction"),
    [
        (0.001, 0.1),
        (0.1, 0.001),
        (0.1, 0.1),
        (0.37, 0.21),
        (0.5, 0.49),
        (0.9, 0.05),
        (0.001, 0.998),
        (0.3, 0.3),
    ],
)
def test_min_text_length_is_where_every_longer_text_fits(
    val_fraction: float, test_fraction: float
) -> None:
    seq_len = 5
    window = seq_len + 1
    minimum = min_text_length(seq_len, val_fraction, test_fraction)

    def fits(n: int) -> bool:
        n_val, n_test = int(n * val_fraction), int(n * test_fraction)
        return min(n_val, n_test, n - n_val - n_test) >= window

    assert not fits(minimum - 1)
    assert all(fits(n) for n in range(minimum, 3 * minimum))


def test_min_text_length_lies_past_a_length_that_fits_before_one_that_does_not() -> None:
    """Both held-out parts can grow at the same length and shrink the train part, so
    the length the error message promises is past such a gap, not the first that fits."""
    seq_len, val_fraction, test_fraction = 4, 0.3, 0.5
    window = seq_len + 1

    def parts(n: int) -> tuple[int, int, int]:
        n_val, n_test = int(n * val_fraction), int(n * test_fraction)
        return n - n_val - n_test, n_val, n_test

    assert parts(19) == (5, 5, 9) and min(parts(19)) >= window  # fits
    assert parts(20) == (4, 6, 10)  # one character longer, and train is a window short
    assert min_text_length(seq_len, val_fraction, test_fraction) == 21


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"n_train": 0}, "n_train"),
        ({"branching": 17}, "branching"),
        ({"val_fraction": 0.2}, "val_fraction"),
        ({"test_fraction": 0.2}, "test_fraction"),
        ({"n_test": 0}, "n_test"),
        ({"n_test": 2.0}, "n_test"),
        ({"data_seed": 1.0}, "data_seed"),
    ],
)
def test_bad_args_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TokenSequenceDataModule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [1.5, 0.0, float("nan"), True])
@pytest.mark.parametrize("field", ["val_fraction", "test_fraction"])
def test_bad_fraction_in_text_mode(tmp_path: Path, field: str, fraction: float) -> None:
    path = _write(tmp_path, "abc" * 100)
    with pytest.raises(ValueError, match=field):
        TokenSequenceDataModule(text_path=path, **{field: fraction})  # type: ignore[arg-type]


def test_fractions_that_leave_no_train_text_are_refused_with_the_fix(tmp_path: Path) -> None:
    path = _write(tmp_path, "abc" * 100)
    with pytest.raises(ValueError) as info:
        TokenSequenceDataModule(text_path=path, val_fraction=0.5, test_fraction=0.5)
    message = str(info.value)
    assert message.startswith("TokenSequenceDataModule.test_fraction: ")
    assert "val_fraction + test_fraction < 1" in message


@pytest.mark.parametrize("field", ["n_train", "n_val", "n_test"])
def test_synthetic_sizes_are_refused_with_a_text(tmp_path: Path, field: str) -> None:
    path = _write(tmp_path, "abc" * 100)
    with pytest.raises(ValueError, match=f"{field}: applies only to synthetic"):
        TokenSequenceDataModule(text_path=path, **{field: 8})  # type: ignore[arg-type]
