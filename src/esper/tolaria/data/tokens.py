"""Token sequences for the Transformer host: a synthetic Markov chain, or a user's text.

Language modelling here means next-token prediction: batches are int64 ``x [B, T]``
and ``y [B, T]`` with ``y[:, t]`` the token that follows ``x[:, t]``.

The default is synthetic, so the Transformer host has a task with no download: a
seeded Markov chain whose every token has only a few possible successors. Its
entropy per step is far below ``log(vocab_size)``, so a small model visibly learns
it. With ``text_path`` the module reads a UTF-8 file at character level instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from esper.contracts.config_errors import ConfigError, require_int
from esper.tolaria.data.base import (
    TASK_LANGUAGE_MODEL,
    DataSplits,
    HostDataModule,
    Task,
    held_out_fractions,
)

DEFAULT_VOCAB_SIZE = 16
DEFAULT_SEQ_LEN = 32
DEFAULT_TOKEN_N_TRAIN = 512
DEFAULT_TOKEN_N_VAL = 128
DEFAULT_TOKEN_N_TEST = 128
# Successors per token: two keeps the entropy at most 1 bit/step against 4 for uniform.
DEFAULT_BRANCHING = 2
DEFAULT_TEXT_VAL_FRACTION = 0.1
DEFAULT_TEXT_TEST_FRACTION = 0.1
DEFAULT_DATA_SEED = 0
MIN_VOCAB_SIZE = 2
# Text mode needs at least two distinct characters, or there is nothing to predict.
MIN_TEXT_VOCAB = 2


class TokenSequenceDataModule(HostDataModule):
    """Next-token batches; ``input_shape`` is ``(seq_len,)`` and ``n_classes`` the vocabulary.

    Every mode builds train, validation and a held-out test split; training never reads
    the test split (validation pays the reward and opens the gates, so only test can
    report results), evaluation reads it through ``host_test_dataloader``.

    Synthetic mode (no ``text_path``): ``n_train`` / ``n_val`` / ``n_test`` sequences
    from one seeded chain over ``vocab_size`` tokens, each token with ``branching``
    successors drawn with random probabilities. ``data_seed`` fixes the chain and the
    samples; ``seed`` only orders the batches. The test sequences are drawn after the
    validation ones, so the train and validation sequences are the same as before the
    test split existed.

    Text mode (``text_path``): the vocabulary is the sorted set of characters in the
    file (``vocab``); the text is split by position into train | validation | test: the
    last ``test_fraction`` is the test part, the ``val_fraction`` before it validation,
    and the rest (the front) train. Each part is cut into windows of ``seq_len + 1``
    characters with stride ``seq_len``, so every next-character pair inside a part is
    used exactly once. Options that belong to the other mode are refused rather than
    silently ignored.

    Args:
        seq_len: tokens per sequence, the host's input length.
        vocab_size: synthetic mode: tokens in the chain (null: the built-in default);
            with text_path the text sets it, so leave it unset.
        n_train: synthetic mode: training sequences (null: the built-in default); leave
            unset with text_path.
        n_val: synthetic mode: validation sequences (null: the built-in default); leave
            unset with text_path.
        n_test: synthetic mode: held-out test sequences, read only by evaluation (null:
            the built-in default); leave unset with text_path.
        branching: synthetic mode: possible successors of each token, at most vocab_size
            (null: the built-in default); fewer makes the chain easier to predict.
        data_seed: synthetic mode: seed of the chain and its sequences, separate from the
            shuffle seed.
        text_path: a UTF-8 text file to model character by character instead of the
            synthetic chain.
        val_fraction: text mode: the fraction of the text, just before the test part,
            held out for validation (null: the built-in default); refused without
            text_path.
        test_fraction: text mode: the last fraction of the text, held out as the test
            split that only evaluation reads (null: the built-in default); refused
            without text_path. val_fraction + test_fraction must stay below 1.
        loading: the loaders' ``batch_size``, ``val_batch_size``, ``num_workers`` and
            ``seed``, as :class:`~esper.tolaria.data.base.HostDataModule` takes them.
    """

    def __init__(
        self,
        *,
        seq_len: int = DEFAULT_SEQ_LEN,
        vocab_size: int | None = None,
        n_train: int | None = None,
        n_val: int | None = None,
        n_test: int | None = None,
        branching: int | None = None,
        data_seed: int = DEFAULT_DATA_SEED,
        text_path: str | os.PathLike[str] | None = None,
        val_fraction: float | None = None,
        test_fraction: float | None = None,
        **loading: Any,
    ) -> None:
        super().__init__(**loading)
        self.seq_len = require_int("seq_len", seq_len, 1)
        self.data_seed = require_int("data_seed", data_seed, 0)
        self.text_path: Path | None = None
        self.vocab: tuple[str, ...] | None = None
        # Synthetic mode only (None with text_path); the chain is filled by ``setup``.
        self.n_train: int | None = None
        self.n_val: int | None = None
        self.n_test: int | None = None
        self.branching: int | None = None
        self.transition_successors: torch.Tensor | None = None
        self.transition_probs: torch.Tensor | None = None
        # Text mode only (None without text_path).
        self.val_fraction: float | None = None
        self.test_fraction: float | None = None
        self._char_to_id: dict[str, int] = {}
        self._text_ids: torch.Tensor | None = None

        if text_path is None:
            for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
                if value is not None:
                    raise ConfigError(
                        name,
                        "applies only with text_path; synthetic mode takes "
                        f"n_train/n_val/n_test, so leave {name} unset",
                    )
            self._vocab_size = require_int(
                "vocab_size", _or(vocab_size, DEFAULT_VOCAB_SIZE), MIN_VOCAB_SIZE
            )
            self.n_train = require_int("n_train", _or(n_train, DEFAULT_TOKEN_N_TRAIN), 1)
            self.n_val = require_int("n_val", _or(n_val, DEFAULT_TOKEN_N_VAL), 1)
            self.n_test = require_int("n_test", _or(n_test, DEFAULT_TOKEN_N_TEST), 1)
            self.branching = require_int("branching", _or(branching, DEFAULT_BRANCHING), 1)
            if self.branching > self._vocab_size:
                raise ConfigError(
                    "branching",
                    f"must be <= vocab_size ({self._vocab_size}), got {self.branching}",
                )
            return

        for name, value in (
            ("vocab_size", vocab_size),
            ("n_train", n_train),
            ("n_val", n_val),
            ("n_test", n_test),
            ("branching", branching),
        ):
            if value is not None:
                raise ConfigError(
                    name,
                    f"applies only to synthetic sequences; with text_path the text sets it, "
                    f"so leave {name} unset",
                )
        val_part = _or(val_fraction, DEFAULT_TEXT_VAL_FRACTION)
        test_part = _or(test_fraction, DEFAULT_TEXT_TEST_FRACTION)
        self.val_fraction, self.test_fraction = held_out_fractions(val_part, test_part)
        self.text_path = Path(text_path).expanduser()
        # Read now, not in setup: the host is built from ``n_classes`` before any data loads.
        self._load_text()

    @property
    def task(self) -> Task:
        return TASK_LANGUAGE_MODEL

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.seq_len,)

    @property
    def n_classes(self) -> int:
        return self._vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> torch.Tensor:
        """Text mode only: characters to int64 ids; an unknown character is an error."""
        if self.vocab is None:
            raise ValueError("encode needs text_path: synthetic tokens have no characters")
        unknown = sorted(set(text) - self._char_to_id.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary of {self.text_path}: {unknown!r}")
        return torch.tensor([self._char_to_id[ch] for ch in text], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        """Text mode only: int ids back to text, for looking at samples."""
        if self.vocab is None:
            raise ValueError("decode needs text_path: synthetic tokens have no characters")
        vocab = self.vocab
        return "".join(vocab[i] for i in ids.reshape(-1).tolist())

    def _load_text(self) -> None:
        assert self.text_path is not None
        assert self.val_fraction is not None and self.test_fraction is not None
        path = self.text_path
        if not path.is_file():
            raise FileNotFoundError(
                f"text_path {path} does not exist or is not a file; pass a UTF-8 text file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError("text_path", f"{path} is not valid UTF-8: {exc}") from exc
        parts = _part_chars(len(text), self.val_fraction, self.test_fraction)
        if min(parts) < self.seq_len + 1:
            minimum = min_text_length(self.seq_len, self.val_fraction, self.test_fraction)
            raise ConfigError(
                "text_path",
                f"{path} has {len(text)} characters, split {parts[0]} train / {parts[1]} "
                f"validation / {parts[2]} test; with seq_len={self.seq_len}, "
                f"val_fraction={self.val_fraction} and test_fraction={self.test_fraction} "
                f"each part needs one window of seq_len + 1 = {self.seq_len + 1} characters: "
                f"use a text of at least {minimum} characters (or a shorter seq_len)",
            )
        vocab = tuple(sorted(set(text)))
        if len(vocab) < MIN_TEXT_VOCAB:
            raise ConfigError(
                "text_path",
                f"{path} uses {len(vocab)} distinct character(s); "
                f"at least {MIN_TEXT_VOCAB} are needed for a prediction task",
            )
        self.vocab = vocab
        self._vocab_size = len(vocab)
        self._char_to_id = {ch: i for i, ch in enumerate(vocab)}
        self._text_ids = torch.tensor([self._char_to_id[ch] for ch in text], dtype=torch.int64)

    def _build_datasets(self) -> DataSplits:
        if self._text_ids is None:
            return self._build_synthetic()
        assert self.val_fraction is not None and self.test_fraction is not None
        ids = self._text_ids
        n_train, n_val, _ = _part_chars(len(ids), self.val_fraction, self.test_fraction)
        # By position: train | validation | test, the test part last.
        train_ids, val_ids = ids[:n_train], ids[n_train : n_train + n_val]
        test_ids = ids[n_train + n_val :]
        return DataSplits(
            *(_windows(part, self.seq_len) for part in (train_ids, val_ids, test_ids))
        )

    def _build_synthetic(self) -> DataSplits:
        assert self.n_train is not None and self.n_val is not None and self.n_test is not None
        assert self.branching is not None
        generator = torch.Generator().manual_seed(self.data_seed)
        vocab, k = self._vocab_size, self.branching
        # Each token's k distinct successors, and a random distribution over them.
        successors = torch.argsort(torch.rand(vocab, vocab, generator=generator), dim=1)[:, :k]
        probs = torch.rand(vocab, k, generator=generator) + _PROB_FLOOR
        probs = probs / probs.sum(dim=1, keepdim=True)
        self.transition_successors, self.transition_probs = successors, probs
        # In this order: drawing test last keeps train and val what they were without it.
        train = self._sample_chain(self.n_train, successors, probs, generator)
        val = self._sample_chain(self.n_val, successors, probs, generator)
        test = self._sample_chain(self.n_test, successors, probs, generator)
        return DataSplits(train, val, test)

    def _sample_chain(
        self,
        n: int,
        successors: torch.Tensor,
        probs: torch.Tensor,
        generator: torch.Generator,
    ) -> TensorDataset:
        tokens = torch.empty(n, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self._vocab_size, (n,), generator=generator)
        for t in range(self.seq_len):
            current = tokens[:, t]
            choice = torch.multinomial(probs[current], 1, generator=generator).squeeze(1)
            tokens[:, t + 1] = successors[current, choice]
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# Keeps every successor's probability away from zero, so each listed edge really occurs.
_PROB_FLOOR = 0.1
# Characters of slack for float rounding in the two held-out floors (each errs < 1).
_TRAIN_ROUNDING_MARGIN = 2


def _or(value: int | float | None, default: int | float) -> int | float:
    return default if value is None else value


def _held_out_chars(n_chars: int, fraction: float) -> int:
    """Characters of a held-out part (validation or test): ``floor(n_chars * fraction)``."""
    return math.floor(n_chars * fraction)


def _part_chars(n_chars: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """Characters of the (train, validation, test) parts of a text of ``n_chars``."""
    n_val = _held_out_chars(n_chars, val_fraction)
    n_test = _held_out_chars(n_chars, test_fraction)
    return n_chars - n_val - n_test, n_val, n_test


def min_text_length(seq_len: int, val_fraction: float, test_fraction: float) -> int:
    """Fewest characters from which on every text leaves one ``seq_len + 1`` window in
    each of the train, validation and test parts.

    The held-out parts only grow with the text, but the train part can shrink by one
    character when both held-out parts grow at the same length, so a length just below
    the train part's threshold can fit while the next does not; the answer is the length
    after which every text fits (the one the error message can promise).
    """
    window = seq_len + 1
    # Each held-out part: its closed-form bound less one (for float rounding), then up to
    # the exact first fit; these parts never shrink, so every longer text fits them too.
    held_out = []
    for fraction in (val_fraction, test_fraction):
        n = max(window, math.floor(window / fraction) - 1)
        while _held_out_chars(n, fraction) < window:
            n += 1
        held_out.append(n)
    # The train part holds at least n * (1 - val - test) characters less a rounding
    # error far below one, so from ``start`` on it always fits; walk down to the last
    # length where it does not (a few steps unless the fractions leave ~no train text).
    train_share = 1.0 - val_fraction - test_fraction
    n = math.ceil((window + _TRAIN_ROUNDING_MARGIN) / train_share)
    while n > 0 and _part_chars(n, val_fraction, test_fraction)[0] >= window:
        n -= 1
    return max(*held_out, n + 1)


def _windows(ids: torch.Tensor, seq_len: int) -> TensorDataset:
    """Windows of ``seq_len + 1`` with stride ``seq_len``: ``x`` is the head, ``y`` the tail."""
    n_windows = (len(ids) - 1) // seq_len
    starts = torch.arange(n_windows) * seq_len
    windows = ids[starts[:, None] + torch.arange(seq_len + 1)]
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
