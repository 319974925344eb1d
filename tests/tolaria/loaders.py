"""Small in-memory loaders shared by the tolaria tests."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset


def image_loaders(
    n_train: int = 64, n_val: int = 40, batch: int = 16
) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_val, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n_train + n_val,), generator=g)
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=batch)
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=batch)
    return train, val


def token_loaders(vocab: int = 16, seq: int = 12) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (48, seq + 1), generator=g)
    data = TensorDataset(x[:, :-1], x[:, 1:])
    train = DataLoader(Subset(data, range(32)), batch_size=8)
    val = DataLoader(Subset(data, range(32, 48)), batch_size=8)
    return train, val
