"""CIFAR-10 from the standard python-pickle release, read with pickle and numpy only.

No torchvision: it would be a heavy dependency for six files, and its downloader would
reach the network behind the user's back. The user downloads the archive once and
points ``root`` at it; anything missing or damaged fails at once with a message that
says what to fix, before a long run has started.
"""

from __future__ import annotations

import os
import pickle
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from esper.contracts.config_errors import ConfigError, require_int, require_number
from esper.tolaria.data.base import (
    TASK_CLASSIFICATION,
    DataSplits,
    HostDataModule,
    Task,
)

CIFAR10_DIRNAME = "cifar-10-batches-py"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_N_TRAIN_BATCHES = 5
CIFAR10_TRAIN_FILES: tuple[str, ...] = tuple(
    f"data_batch_{i}" for i in range(1, CIFAR10_N_TRAIN_BATCHES + 1)
)
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_EXPECTED_FILES: tuple[str, ...] = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
CIFAR10_SHAPE: tuple[int, int, int] = (3, 32, 32)
CIFAR10_N_CHANNELS = CIFAR10_SHAPE[0]
CIFAR10_ROW_LENGTH = CIFAR10_SHAPE[0] * CIFAR10_SHAPE[1] * CIFAR10_SHAPE[2]  # 3072 bytes
CIFAR10_N_CLASSES = 10
# Pixels are uint8, so a histogram over every possible value gives exact channel stats.
PIXEL_LEVELS = 256
PIXEL_MAX = 255.0
# Guards the division for a degenerate (e.g. constant) channel in a tiny subset.
MIN_STD = 1e-8
# Validation: the front tenth of each training batch file (1000 images each, 5000 in all).
DEFAULT_VAL_FRACTION = 0.1

# The release pickles hold only a dict of bytes, lists and numpy arrays; refusing every
# other global means a tampered file cannot run code when it is loaded.
_ALLOWED_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # Python 3 writes bytes in protocol-2 pickles as ``_codecs.encode(str, "latin1")``.
        ("_codecs", "encode"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
    }
)


# What a truncated, foreign or tampered pickle raises while loading.
_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    AttributeError,
    ImportError,
    IndexError,
    KeyError,
    TypeError,
    ValueError,
    MemoryError,
)


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _ALLOWED_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: a CIFAR-10 batch holds only numpy arrays"
            )
        return super().find_class(module, name)


class Cifar10DataModule(HostDataModule):
    """The release's 50 000 training images split into train and validation; its
    10 000 ``test_batch`` images are the test split.

    Validation is what the run itself reads (it pays the reward, opens the gates and
    picks the best checkpoint), so it cannot be the official test set: that is held
    out as the test split, which training never reads and only evaluation does. The
    validation split is carved from the training batch files instead: the first
    ``val_fraction`` of each ``data_batch_i`` file (in file order) is validation and the
    rest of that file is train, so with the default 0.1 the splits are 45 000 train,
    5 000 validation and 10 000 test images. Both depend on the release and
    ``val_fraction`` only, never on the seed.

    ``root`` may be the ``cifar-10-batches-py`` folder itself or the folder that holds
    it (where the archive was extracted). The files are checked at construction, so a
    wrong path fails before any model is built. Inputs are scaled to [0, 1] and then
    standardised per channel with the mean and std of the train split in use, so
    neither held-out split leaks into training.

    ``limit_train`` / ``limit_val`` / ``limit_test`` keep only the first N images of
    each split (the release batches are already shuffled, so a prefix is close to
    class-balanced); each limit takes a prefix of the same full split, so a limit never
    changes which images the other splits hold. Training batch files past what both
    limits need are not even read, which makes smoke runs fast: with ``limit_train``
    up to 9 000 and ``limit_val`` up to 1 000, only ``data_batch_1`` is read.

    Args:
        root: the extracted cifar-10-batches-py folder, or the folder that holds it
            (download the python release once; nothing is downloaded for you).
        val_fraction: the front fraction of each training batch file held out for
            validation, strictly between 0 and 1; the rest of the file is train.
        limit_train: keep only the first N training images, for fast smoke runs; null
            uses all of them (45 000 with the default val_fraction).
        limit_val: keep only the first N validation images; null uses all of them
            (5 000 with the default val_fraction).
        limit_test: keep only the first N test images (of test_batch), read only by
            evaluation; null uses all 10 000.
        loading: the loaders' ``batch_size``, ``val_batch_size``, ``num_workers`` and
            ``seed``, as :class:`~esper.tolaria.data.base.HostDataModule` takes them.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        limit_train: int | None = None,
        limit_val: int | None = None,
        limit_test: int | None = None,
        **loading: Any,
    ) -> None:
        super().__init__(**loading)
        self.limit_train = (
            None if limit_train is None else require_int("limit_train", limit_train, 1)
        )
        self.limit_val = None if limit_val is None else require_int("limit_val", limit_val, 1)
        self.limit_test = None if limit_test is None else require_int("limit_test", limit_test, 1)
        require_number("val_fraction", val_fraction, above=0.0, below=1.0)
        self.val_fraction = float(val_fraction)
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise ConfigError("root", f"must be a non-empty path to CIFAR-10, got {root!r}")
        self.data_dir = find_cifar10_dir(root)
        # Filled by ``setup``: the per-channel statistics used to standardise inputs.
        self.channel_mean: tuple[float, ...] | None = None
        self.channel_std: tuple[float, ...] | None = None

    @property
    def task(self) -> Task:
        return TASK_CLASSIFICATION

    @property
    def input_shape(self) -> tuple[int, ...]:
        return CIFAR10_SHAPE

    @property
    def n_classes(self) -> int:
        return CIFAR10_N_CLASSES

    def _build_datasets(self) -> DataSplits:
        try:
            (train_x, train_y), (val_x, val_y) = _load_train_and_val(
                self.data_dir, self.val_fraction, self.limit_train, self.limit_val
            )
            test_x, test_y = _load_test(self.data_dir, self.limit_test)
        except ValueError as exc:  # a damaged file: named by the key that points at it
            raise ConfigError("root", str(exc), type(self)) from exc
        if len(val_y) == 0:
            raise ConfigError(
                "root",
                f"the training batch files in {self.data_dir} leave no image for validation "
                "(a file needs at least 2 images to give one to each split); re-extract "
                f"them from {CIFAR10_URL}",
                type(self),
            )
        mean, std = _channel_stats(train_x)
        self.channel_mean, self.channel_std = tuple(mean.tolist()), tuple(std.tolist())

        def standardised(x: np.ndarray, y: np.ndarray) -> TensorDataset:
            return TensorDataset(_standardise(x, mean, std), torch.from_numpy(y))

        return DataSplits(
            standardised(train_x, train_y),
            standardised(val_x, val_y),
            standardised(test_x, test_y),
        )


def find_cifar10_dir(root: str | os.PathLike[str]) -> Path:
    """Resolve ``root`` (the batches folder or its parent) and check every file is there.

    Raises one ``FileNotFoundError`` that names where it looked, the files it expects,
    which of them are missing, and where to download the release.
    """
    root_path = Path(root).expanduser()
    nested = root_path / CIFAR10_DIRNAME
    candidates = [nested, root_path]
    # Prefer whichever candidate already holds some release files; else report the nested one.
    chosen = next(
        (
            c
            for c in candidates
            if c.is_dir() and any((c / f).is_file() for f in CIFAR10_EXPECTED_FILES)
        ),
        None,
    )
    if chosen is None:
        looked = " and ".join(str(c) for c in candidates)
        raise FileNotFoundError(
            f"CIFAR-10 not found: looked in {looked}, which hold none of the expected files "
            f"{', '.join(CIFAR10_EXPECTED_FILES)}. {_download_hint(root_path)}"
        )
    missing = [f for f in CIFAR10_EXPECTED_FILES if not (chosen / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 folder {chosen} is incomplete: missing {', '.join(missing)} "
            f"(expected files: {', '.join(CIFAR10_EXPECTED_FILES)}). {_download_hint(root_path)}"
        )
    return chosen


def _download_hint(root: Path) -> str:
    """How to get the files where ``root`` will find them, as commands that run as shown.

    The archive holds ``cifar-10-batches-py/``, so it is extracted into the folder that
    will hold that one: ``root`` itself, or its parent where ``root`` already names
    ``cifar-10-batches-py`` (extracting into it would nest the folder twice). ``tar -C``
    needs its folder to exist, hence the ``mkdir -p``.
    """
    into = root.parent if root.name == CIFAR10_DIRNAME else root
    target = shlex.quote(str(into))
    return (
        f"Download {CIFAR10_URL} and extract it with `mkdir -p {target} && tar -xzf "
        f"cifar-10-python.tar.gz -C {target}`, which creates {into / CIFAR10_DIRNAME}; "
        "pass either that folder or its parent as root."
    )


def _load_train_and_val(
    data_dir: Path, val_fraction: float, limit_train: int | None, limit_val: int | None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train, validation) from the training batch files, read in order.

    Each file's first ``_val_rows(len(file), val_fraction)`` rows go to validation and
    the rest to train; reading stops once both limits are met, and each split is then
    cut to its limit.
    """
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
    limits = {"train": limit_train, "val": limit_val}
    for name in CIFAR10_TRAIN_FILES:
        if all(_reached(parts[split], limits[split]) for split in parts):
            break
        x, y = load_cifar10_batch(data_dir / name)
        n_val = _val_rows(len(y), val_fraction)
        parts["val"].append((x[:n_val], y[:n_val]))
        parts["train"].append((x[n_val:], y[n_val:]))
    train = _concat_prefix(parts["train"], limit_train)
    val = _concat_prefix(parts["val"], limit_val)
    return train, val


def _val_rows(n_rows: int, val_fraction: float) -> int:
    """Validation rows of a training batch file: ``round(val_fraction * n_rows)``,
    clamped so a file of two or more rows gives at least one to each split."""
    return min(max(round(val_fraction * n_rows), 1), n_rows - 1) if n_rows > 1 else 0


def _reached(chunks: Sequence[tuple[np.ndarray, np.ndarray]], limit: int | None) -> bool:
    return limit is not None and sum(len(y) for _, y in chunks) >= limit


def _concat_prefix(
    chunks: Sequence[tuple[np.ndarray, np.ndarray]], limit: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The chunks joined in order, then cut to the first ``limit`` rows."""
    x_all = np.concatenate([x for x, _ in chunks])
    y_all = np.concatenate([y for _, y in chunks])
    if limit is not None:
        x_all, y_all = x_all[:limit], y_all[:limit]
    return x_all, y_all


def _load_test(data_dir: Path, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The test split: ``test_batch``, cut to its first ``limit`` rows."""
    x, y = load_cifar10_batch(data_dir / CIFAR10_TEST_FILE)
    return (x, y) if limit is None else (x[:limit], y[:limit])


def load_cifar10_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One release batch as (uint8 ``[N, 3, 32, 32]``, int64 ``[N]``).

    Any damage (not a pickle, wrong keys, wrong shape or dtype, out-of-range labels)
    raises a ``ValueError`` that names the file, so the user knows which one to replace.
    """
    try:
        with path.open("rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except _UNPICKLE_ERRORS as exc:
        raise ValueError(
            f"CIFAR-10 batch {path} is not a readable pickle ({type(exc).__name__}: {exc}); "
            f"re-extract it from {CIFAR10_URL}"
        ) from exc
    if not isinstance(batch, dict):
        raise ValueError(f"CIFAR-10 batch {path} holds a {type(batch).__name__}, not a dict")
    data = _get_key(batch, "data", path)
    labels = _get_key(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(
            f"CIFAR-10 batch {path}: 'data' must be a uint8 array [N, {CIFAR10_ROW_LENGTH}], "
            f"got {_describe(data)}"
        )
    if data.shape[1] != CIFAR10_ROW_LENGTH:
        raise ValueError(
            f"CIFAR-10 batch {path}: 'data' rows must hold {CIFAR10_ROW_LENGTH} bytes "
            f"(3x32x32), got shape {tuple(data.shape)}"
        )
    try:
        label_arr = np.asarray(labels)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"CIFAR-10 batch {path}: 'labels' is not a list of ints") from exc
    if label_arr.ndim != 1 or not np.issubdtype(label_arr.dtype, np.integer):
        raise ValueError(
            f"CIFAR-10 batch {path}: 'labels' must be a 1-D list of ints, got {_describe(labels)}"
        )
    if len(label_arr) != len(data):
        raise ValueError(f"CIFAR-10 batch {path}: {len(data)} images but {len(label_arr)} labels")
    if len(label_arr) and (label_arr.min() < 0 or label_arr.max() >= CIFAR10_N_CLASSES):
        raise ValueError(
            f"CIFAR-10 batch {path}: labels must lie in [0, {CIFAR10_N_CLASSES}), "
            f"got [{label_arr.min()}, {label_arr.max()}]"
        )
    return data.reshape(-1, *CIFAR10_SHAPE), label_arr.astype(np.int64)


def _get_key(batch: dict[object, object], key: str, path: Path) -> object:
    """The release uses bytes keys; a file re-pickled under Python 3 may use str keys."""
    for candidate in (key.encode(), key):
        if candidate in batch:
            return batch[candidate]
    raise ValueError(
        f"CIFAR-10 batch {path} has no {key!r} entry (keys: {sorted(map(str, batch))})"
    )


def _describe(obj: object) -> str:
    if isinstance(obj, np.ndarray):
        return f"{obj.dtype} array of shape {tuple(obj.shape)}"
    return type(obj).__name__


def _channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean/std of ``images / 255`` from pixel histograms.

    Histograms avoid a float64 copy of the whole split (about 1.2 GB for CIFAR-10).
    """
    levels = np.arange(PIXEL_LEVELS, dtype=np.float64) / PIXEL_MAX
    mean = np.empty(CIFAR10_N_CHANNELS)
    std = np.empty(CIFAR10_N_CHANNELS)
    for c in range(CIFAR10_N_CHANNELS):
        counts = np.bincount(images[:, c].ravel(), minlength=PIXEL_LEVELS).astype(np.float64)
        p = counts / counts.sum()
        mean[c] = float(p @ levels)
        std[c] = max(float(np.sqrt(p @ (levels - mean[c]) ** 2)), MIN_STD)
    return mean, std


def _standardise(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """float32 ``(x / 255 - mean) / std`` per channel, computed in place on one copy."""
    x = torch.from_numpy(images).to(torch.float32).div_(PIXEL_MAX)
    shape = (1, CIFAR10_N_CHANNELS, 1, 1)
    x.sub_(torch.from_numpy(mean).to(torch.float32).view(shape))
    x.div_(torch.from_numpy(std).to(torch.float32).view(shape))
    return x
