"""CIFAR-10 loading against tiny fake folders written in the release's pickle format."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from esper.tolaria.data import CIFAR10_URL, Cifar10DataModule
from esper.tolaria.data.cifar10 import (
    CIFAR10_DIRNAME,
    CIFAR10_EXPECTED_FILES,
    CIFAR10_N_CLASSES,
    CIFAR10_ROW_LENGTH,
    CIFAR10_SHAPE,
    CIFAR10_TRAIN_FILES,
    CIFAR10_VAL_FILE,
)

ROWS_PER_FILE = 20
N_TRAIN = ROWS_PER_FILE * len(CIFAR10_TRAIN_FILES)
BATCH = 8


def write_fake_batch(
    path: Path,
    n_rows: int,
    label_offset: int,
    rng: np.random.Generator,
    legacy_numpy: bool = False,
) -> None:
    """One batch as the release stores it: bytes keys, uint8 rows, a list of int labels.

    ``legacy_numpy`` spells the array globals as numpy 1.x did (``numpy.core``), as in
    the files of the actual release.
    """
    batch = {
        b"batch_label": b"fake batch",
        b"labels": [(label_offset + i) % CIFAR10_N_CLASSES for i in range(n_rows)],
        b"data": rng.integers(0, 256, size=(n_rows, CIFAR10_ROW_LENGTH), dtype=np.uint8),
        b"filenames": [f"img_{i}.png".encode() for i in range(n_rows)],
    }
    payload = pickle.dumps(batch, protocol=2)
    if legacy_numpy:
        payload = payload.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy.core.multiarray" in payload
    path.write_bytes(payload)


def make_fake_cifar(
    parent: Path, files: Sequence[str] = CIFAR10_EXPECTED_FILES, legacy_numpy: bool = False
) -> Path:
    folder = parent / CIFAR10_DIRNAME
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate(files):
        write_fake_batch(folder / name, ROWS_PER_FILE, i, rng, legacy_numpy=legacy_numpy)
    return folder


def test_loads_fake_release_from_parent_or_folder(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    for root in (tmp_path, folder, str(folder)):
        dm = Cifar10DataModule(root, batch_size=BATCH, val_batch_size=BATCH)
        assert dm.data_dir == folder
        assert dm.input_shape == CIFAR10_SHAPE
        assert dm.n_classes == CIFAR10_N_CLASSES
        assert dm.task == "classification"
        x, y = dm.train_dataset.tensors
        assert x.shape == (N_TRAIN, *CIFAR10_SHAPE) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        vx, vy = dm.val_dataset.tensors
        assert vx.shape == (ROWS_PER_FILE, *CIFAR10_SHAPE)
        # Labels follow the files in order: file i starts at label i.
        expected_first = [i % CIFAR10_N_CLASSES for i in range(len(CIFAR10_TRAIN_FILES))]
        assert y[::ROWS_PER_FILE].tolist() == expected_first
        val_offset = len(CIFAR10_TRAIN_FILES)
        assert vy.tolist() == [(val_offset + i) % CIFAR10_N_CLASSES for i in range(ROWS_PER_FILE)]


def test_loads_numpy1_era_pickles(tmp_path: Path) -> None:
    make_fake_cifar(tmp_path, legacy_numpy=True)
    dm = Cifar10DataModule(tmp_path, batch_size=BATCH)
    assert dm.train_size == N_TRAIN and dm.val_size == ROWS_PER_FILE


def test_pixels_keep_channel_layout_and_are_standardised(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    with (folder / CIFAR10_TRAIN_FILES[0]).open("rb") as f:
        raw = pickle.load(f, encoding="bytes")[b"data"]
    dm = Cifar10DataModule(tmp_path, batch_size=BATCH)
    x = dm.train_dataset.tensors[0].double()
    # Per channel: mean 0 and std 1 over the train split.
    per_channel = x.transpose(0, 1).reshape(CIFAR10_SHAPE[0], -1)
    assert torch.allclose(per_channel.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(
        per_channel.std(1, correction=0), torch.ones(3, dtype=torch.float64), atol=1e-5
    )
    # Undo the standardisation: row 0 is the raw bytes in (R, G, B) planes of 32x32.
    mean = torch.tensor(dm.channel_mean, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(dm.channel_std, dtype=torch.float64).view(3, 1, 1)
    restored = ((x[0] * std + mean) * 255).round()
    assert torch.equal(restored, torch.from_numpy(raw[0].astype(np.float64)).view(CIFAR10_SHAPE))


def test_limits_take_a_prefix_and_skip_unneeded_files(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    # A damaged later file proves it is never read when the limit is reached before it.
    (folder / CIFAR10_TRAIN_FILES[-1]).write_bytes(b"not a pickle")
    limit_train = ROWS_PER_FILE + 3
    dm = Cifar10DataModule(folder, batch_size=BATCH, limit_train=limit_train, limit_val=5)
    assert dm.train_size == limit_train
    assert dm.val_size == 5


def test_missing_folder_names_path_files_and_download(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        Cifar10DataModule(missing, batch_size=BATCH)
    message = str(info.value)
    assert str(missing) in message
    assert str(missing / CIFAR10_DIRNAME) in message
    for name in CIFAR10_EXPECTED_FILES:
        assert name in message
    assert CIFAR10_URL in message


def test_partially_missing_files_are_listed(tmp_path: Path) -> None:
    present = (*CIFAR10_TRAIN_FILES[:3], CIFAR10_VAL_FILE)
    folder = make_fake_cifar(tmp_path, files=present)
    with pytest.raises(FileNotFoundError) as info:
        Cifar10DataModule(tmp_path, batch_size=BATCH)
    message = str(info.value)
    assert str(folder) in message
    missing_part = message.split("missing ", 1)[1].split(" (", 1)[0]
    assert missing_part == "data_batch_4, data_batch_5"
    assert CIFAR10_URL in message


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"\x00\x01garbage", "not a readable pickle"),
        (pickle.dumps([1, 2, 3]), "not a dict"),
        (pickle.dumps({b"labels": [0]}), "'data'"),
        (
            pickle.dumps({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}),
            "3072",
        ),
        (
            pickle.dumps(
                {b"data": np.zeros((2, CIFAR10_ROW_LENGTH), dtype=np.uint8), b"labels": [0]}
            ),
            "2 images but 1 labels",
        ),
        (
            pickle.dumps(
                {b"data": np.zeros((1, CIFAR10_ROW_LENGTH), dtype=np.uint8), b"labels": [10]}
            ),
            "labels must lie in",
        ),
        # A pickle that would call os.system on load is refused, not executed.
        (b"cos\nsystem\n(S'true'\ntR.", "refusing to load"),
    ],
)
def test_corrupt_file_error_names_the_file(tmp_path: Path, payload: bytes, fragment: str) -> None:
    folder = make_fake_cifar(tmp_path)
    bad = folder / CIFAR10_TRAIN_FILES[0]
    bad.write_bytes(payload)
    dm = Cifar10DataModule(folder, batch_size=BATCH)
    with pytest.raises(ValueError) as info:
        dm.setup()
    assert str(bad) in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"limit_train": 0}, "limit_train"),
        ({"limit_val": 1.5}, "limit_val"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_bad_args_name_the_field(tmp_path: Path, kwargs: dict[str, object], field: str) -> None:
    make_fake_cifar(tmp_path)
    with pytest.raises(ValueError, match=field):
        Cifar10DataModule(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_empty_root_is_refused() -> None:
    with pytest.raises(ValueError, match="root"):
        Cifar10DataModule("", batch_size=BATCH)
