"""CIFAR-10 loading against tiny fake folders written in the release's pickle format."""

from __future__ import annotations

import pickle
import re
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from esper.tolaria.data import CIFAR10_URL, Cifar10DataModule, DataSplits
from esper.tolaria.data.cifar10 import (
    CIFAR10_DIRNAME,
    CIFAR10_EXPECTED_FILES,
    CIFAR10_N_CLASSES,
    CIFAR10_ROW_LENGTH,
    CIFAR10_SHAPE,
    CIFAR10_TEST_FILE,
    CIFAR10_TRAIN_FILES,
)

ROWS_PER_FILE = 20
N_FILES = len(CIFAR10_TRAIN_FILES)
# With the default val_fraction 0.1, each fake training file gives 2 rows to validation.
VAL_PER_FILE = 2
TRAIN_PER_FILE = ROWS_PER_FILE - VAL_PER_FILE
N_TRAIN = TRAIN_PER_FILE * N_FILES
N_VAL = VAL_PER_FILE * N_FILES
N_TEST = ROWS_PER_FILE
BATCH = 8
#: The README's CIFAR-10 command runs on this fake release with --data.batch_size 64.
README_BATCH = 64
SPLITS = DataSplits._fields


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


def raw_rows(folder: Path, name: str) -> np.ndarray:
    """One fake file's uint8 rows, as written."""
    with (folder / name).open("rb") as f:
        return pickle.load(f, encoding="bytes")[b"data"]


def restored_rows(dm: Cifar10DataModule, split: str) -> np.ndarray:
    """A split's images with the standardisation undone: the uint8 rows of the files."""
    x = getattr(dm, f"{split}_dataset").tensors[0].double()
    mean = torch.tensor(dm.channel_mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(dm.channel_std, dtype=torch.float64).view(1, 3, 1, 1)
    pixels = ((x * std + mean) * 255).round()
    return pixels.reshape(len(x), CIFAR10_ROW_LENGTH).numpy().astype(np.uint8)


def test_loads_fake_release_from_parent_or_folder(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    for root in (tmp_path, folder, str(folder)):
        dm = Cifar10DataModule(root, batch_size=BATCH, val_batch_size=BATCH)
        assert dm.data_dir == folder
        assert dm.input_shape == CIFAR10_SHAPE
        assert dm.n_classes == CIFAR10_N_CLASSES
        assert dm.task == "classification"
        for split, n in zip(SPLITS, (N_TRAIN, N_VAL, N_TEST), strict=True):
            x, y = getattr(dm, f"{split}_dataset").tensors
            assert x.shape == (n, *CIFAR10_SHAPE) and x.dtype == torch.float32
            assert y.dtype == torch.int64
        # Labels follow the files in order (row r of file i has label i + r): each file's
        # first rows are validation, the rest train; test_batch (file 5) is test.
        files = range(N_FILES)
        assert dm.val_dataset.tensors[1].tolist() == [
            (i + r) % CIFAR10_N_CLASSES for i in files for r in range(VAL_PER_FILE)
        ]
        assert dm.train_dataset.tensors[1].tolist() == [
            (i + r) % CIFAR10_N_CLASSES for i in files for r in range(VAL_PER_FILE, ROWS_PER_FILE)
        ]
        assert dm.test_dataset.tensors[1].tolist() == [
            (N_FILES + r) % CIFAR10_N_CLASSES for r in range(ROWS_PER_FILE)
        ]


def test_validation_is_the_front_of_each_training_file_and_test_is_test_batch(
    tmp_path: Path,
) -> None:
    folder = make_fake_cifar(tmp_path)
    dm = Cifar10DataModule(folder, batch_size=BATCH)
    files = [raw_rows(folder, name) for name in CIFAR10_TRAIN_FILES]
    expected = {
        "train": np.concatenate([rows[VAL_PER_FILE:] for rows in files]),
        "val": np.concatenate([rows[:VAL_PER_FILE] for rows in files]),
        "test": raw_rows(folder, CIFAR10_TEST_FILE),
    }
    for split in SPLITS:
        assert np.array_equal(restored_rows(dm, split), expected[split]), split


def test_the_three_splits_share_no_image(tmp_path: Path) -> None:
    dm = Cifar10DataModule(make_fake_cifar(tmp_path), batch_size=BATCH)
    images = {split: {row.tobytes() for row in restored_rows(dm, split)} for split in SPLITS}
    assert [len(images[split]) for split in SPLITS] == [N_TRAIN, N_VAL, N_TEST]
    assert not images["train"] & images["val"]
    assert not images["train"] & images["test"]
    assert not images["val"] & images["test"]


def test_splits_do_not_depend_on_the_shuffle_seed(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    a = Cifar10DataModule(folder, batch_size=BATCH, seed=0)
    b = Cifar10DataModule(folder, batch_size=BATCH, seed=7)
    for split in SPLITS:
        for ta, tb in zip(
            getattr(a, f"{split}_dataset").tensors,
            getattr(b, f"{split}_dataset").tensors,
            strict=True,
        ):
            assert torch.equal(ta, tb)


def test_val_fraction_sets_the_rows_each_file_gives_to_validation(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    dm = Cifar10DataModule(folder, val_fraction=0.5, batch_size=BATCH)
    half = ROWS_PER_FILE // 2
    assert (dm.train_size, dm.val_size, dm.test_size) == (half * N_FILES, half * N_FILES, N_TEST)


def test_defaults_on_the_fake_release_hold_a_readme_batch(tmp_path: Path) -> None:
    """tests/test_readme.py runs the README's CIFAR-10 command on this fake release."""
    dm = Cifar10DataModule(make_fake_cifar(tmp_path), batch_size=README_BATCH)
    assert dm.train_size >= README_BATCH
    assert len(list(dm.host_train_dataloader())) == N_TRAIN // README_BATCH


def test_test_loader_yields_the_whole_test_split_in_order(tmp_path: Path) -> None:
    dm = Cifar10DataModule(make_fake_cifar(tmp_path), batch_size=BATCH, val_batch_size=BATCH)
    batches = list(dm.host_test_dataloader())
    assert [len(y) for _, y in batches] == [BATCH, BATCH, N_TEST - 2 * BATCH]
    assert torch.equal(torch.cat([x for x, _ in batches]), dm.test_dataset.tensors[0])
    assert torch.equal(torch.cat([y for _, y in batches]), dm.test_dataset.tensors[1])


def test_loads_numpy1_era_pickles(tmp_path: Path) -> None:
    make_fake_cifar(tmp_path, legacy_numpy=True)
    dm = Cifar10DataModule(tmp_path, batch_size=BATCH)
    assert (dm.train_size, dm.val_size, dm.test_size) == (N_TRAIN, N_VAL, N_TEST)


def test_pixels_keep_channel_layout_and_are_standardised(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    raw = raw_rows(folder, CIFAR10_TRAIN_FILES[0])[VAL_PER_FILE:]  # train starts past val
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


def test_channel_statistics_come_from_the_train_split_only(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    dm = Cifar10DataModule(folder, batch_size=BATCH)
    dm.setup()
    train = np.concatenate([raw_rows(folder, n)[VAL_PER_FILE:] for n in CIFAR10_TRAIN_FILES])
    per_channel = train.reshape(len(train), 3, -1).transpose(1, 0, 2).reshape(3, -1) / 255.0
    assert np.allclose(dm.channel_mean, per_channel.mean(1))
    assert np.allclose(dm.channel_std, per_channel.std(1))


def test_limits_take_a_prefix_of_each_split_and_skip_unneeded_files(tmp_path: Path) -> None:
    folder = make_fake_cifar(tmp_path)
    full = Cifar10DataModule(folder, batch_size=BATCH)
    expected = {split: restored_rows(full, split) for split in SPLITS}
    # Damaged later files prove they are never read once both limits are met before them.
    for name in CIFAR10_TRAIN_FILES[2:]:
        (folder / name).write_bytes(b"not a pickle")
    limits = {"train": TRAIN_PER_FILE + 3, "val": VAL_PER_FILE + 1, "test": 5}
    dm = Cifar10DataModule(
        folder,
        batch_size=BATCH,
        limit_train=limits["train"],
        limit_val=limits["val"],
        limit_test=limits["test"],
    )
    assert (dm.train_size, dm.val_size, dm.test_size) == tuple(limits.values())
    for split in SPLITS:
        assert np.array_equal(restored_rows(dm, split), expected[split][: limits[split]])


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


@pytest.mark.parametrize("given", ["data", f"data/{CIFAR10_DIRNAME}"])
def test_the_download_hint_runs_as_written_and_the_root_then_loads(
    tmp_path: Path, given: str
) -> None:
    # The archive as released: cifar-10-batches-py/ at its top.
    release = tmp_path / "release"
    make_fake_cifar(release)
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as archive:
        archive.add(release / CIFAR10_DIRNAME, arcname=CIFAR10_DIRNAME)
    root = tmp_path / given  # does not exist yet, nor does its parent
    with pytest.raises(FileNotFoundError) as info:
        Cifar10DataModule(root, batch_size=BATCH)
    command = re.search(r"`(mkdir -p .*? && tar -xzf .*?)`", str(info.value))
    assert command is not None, str(info.value)
    subprocess.run(command.group(1), shell=True, cwd=tmp_path, check=True)
    assert not (tmp_path / "data" / CIFAR10_DIRNAME / CIFAR10_DIRNAME).exists(), "nested twice"
    Cifar10DataModule(root, batch_size=BATCH)  # found where the hint put it


def test_partially_missing_files_are_listed(tmp_path: Path) -> None:
    present = (*CIFAR10_TRAIN_FILES[:3], CIFAR10_TEST_FILE)
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
        ({"limit_test": 0}, "limit_test"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": float("nan")}, "val_fraction"),
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
