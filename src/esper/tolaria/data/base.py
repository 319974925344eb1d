"""The shared shape of every host data module: in-memory tensors, seeded shuffling.

The trainer splits each train batch across its parallel environments, so every
train batch must have exactly ``batch_size`` rows: hence ``drop_last=True`` and the
check that the train split holds at least one full batch.

Every module builds three splits (:class:`DataSplits`). The validation split is not
held out from the run: it pays the policy's reward, feeds its observations, opens the
lifecycle gates and picks the best checkpoint, so a figure measured on it is biased in
the run's favour. The test split is the one held out: training never reads it, and only
:meth:`HostDataModule.host_test_dataloader` (which evaluation calls) does.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from typing import Any, Literal, NamedTuple

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from esper.contracts.config_errors import ConfigError, owned_by, require_int, require_number
from esper.tolaria.shares import index_on

TASK_CLASSIFICATION = "classification"
TASK_LANGUAGE_MODEL = "language_model"
Task = Literal["classification", "language_model"]

DEFAULT_BATCH_SIZE = 128
DEFAULT_VAL_BATCH_SIZE = 512
DEFAULT_NUM_WORKERS = 0
DEFAULT_SEED = 0
#: Splits up to this size live on the training accelerator (see ``resident_bytes``).
DEFAULT_RESIDENT_BYTES = 2**30


class DataSplits(NamedTuple):
    """The three splits ``HostDataModule._build_datasets`` returns, each with its own job.

    Attributes:
        train: what the hosts train on, in shuffled batches of ``batch_size``.
        val: what the run itself measures: it pays the reward, feeds the observations,
            opens the gates and picks the best checkpoint, so it cannot report results.
        test: held out from all of that; read only through ``host_test_dataloader``,
            by evaluation, so its figures are unbiased by the run.
    """

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset


def held_out_fractions(val_fraction: float, test_fraction: float) -> tuple[float, float]:
    """``(val_fraction, test_fraction)`` as floats, each in (0, 1) and leaving training
    data: the check every module that holds out fractions of one pool shares."""
    require_number("val_fraction", val_fraction, above=0.0, below=1.0)
    require_number("test_fraction", test_fraction, above=0.0, below=1.0)
    val, test = float(val_fraction), float(test_fraction)
    if val + test >= 1.0:
        raise ConfigError(
            "test_fraction",
            f"{test_fraction} plus val_fraction {val_fraction} leaves nothing to train on; "
            f"allowed: val_fraction + test_fraction < 1 (lower test_fraction below "
            f"{1.0 - val:g} or lower val_fraction)",
        )
    return val, test


class _RolloutTicks(Dataset[int]):
    """A one-item dataset: the item is a tick that starts one rollout."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        if index != 0:
            raise IndexError(index)
        return 0


class HostDataModule(LightningDataModule, ABC):
    """Base for the data a host network trains on.

    Subclasses only build three ``TensorDataset``s (:class:`DataSplits`: train, val,
    test); the loaders, the seeding and the batch-size check live here so every data
    source behaves the same for the trainer.

    Training reads train and val only. Validation cannot report results: it pays the RL
    reward, feeds the observations, opens the lifecycle gates and picks the best
    checkpoint. So every module also holds out a test split that nothing in a fit reads
    (not training, rewards, observations, gates or checkpoint selection); only
    :meth:`host_test_dataloader` reads it, and only evaluation calls that. There is no
    Lightning ``test_dataloader`` hook on purpose: ``trainer.test`` is not how Esper
    evaluates, and a hook would invite reading the test split mid-run.

    Batches are ``(x, y)``: classification gives float32 ``x`` and int64 ``y [B]``;
    language modelling gives int64 ``x [B, T]`` and ``y [B, T]`` with ``y`` the
    next-token targets of ``x``.

    Args:
        batch_size: host training batch; each batch is split into one share per env of
            the rank, so it must be at least the envs per rank and fit in the train split.
        val_batch_size: samples per batch of the host validation pass; changes memory
            use and speed, not the figures (every validation sample counts).
        num_workers: DataLoader worker processes for the host loaders; 0 loads in the
            main process.
        seed: seed of the host train loader's shuffle order (offset per DDP rank); the
            samples themselves do not depend on it.
        resident_bytes: a split of at most this many bytes is copied once to the
            accelerator a fit trains on (``trainer.strategy.root_device``, not a CPU), and
            its batches are gathered there: the same rows in the same order, without a
            pinned copy and an upload of every batch. 0 keeps every split on the host;
            so do ``num_workers > 0`` and loaders built outside a fit (evaluation).
    """

    #: The keyword arguments the module was built with (filled in by ``__init_subclass__``),
    #: so a checkpoint can say which data it was trained on and evaluation can rebuild it.
    init_args: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self: HostDataModule, *args: Any, **kw: Any) -> None:
            if "init_args" not in self.__dict__:  # the most derived class records
                bound = signature.bind(self, *args, **kw)
                bound.apply_defaults()
                self.init_args = _recorded(signature, bound.arguments)
            with owned_by(self):  # an argument's error names this class and the argument
                init(self, *args, **kw)

        cls.__init__ = recording_init  # type: ignore[method-assign]

    def __init__(
        self,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        val_batch_size: int = DEFAULT_VAL_BATCH_SIZE,
        num_workers: int = DEFAULT_NUM_WORKERS,
        seed: int = DEFAULT_SEED,
        resident_bytes: int = DEFAULT_RESIDENT_BYTES,
    ) -> None:
        super().__init__()
        with owned_by(self):  # also for a subclass that keeps this __init__ as its own
            self.batch_size = require_int("batch_size", batch_size, 1)
            self.val_batch_size = require_int("val_batch_size", val_batch_size, 1)
            self.num_workers = require_int("num_workers", num_workers, 0)
            self.seed = require_int("seed", seed, 0)
            self.resident_bytes = require_int("resident_bytes", resident_bytes, 0)
        self._train_set: TensorDataset | None = None
        self._val_set: TensorDataset | None = None
        self._test_set: TensorDataset | None = None

    @property
    @abstractmethod
    def task(self) -> Task:
        """Which loss and metrics the trainer must use for these batches."""

    @property
    @abstractmethod
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample input shape, without the batch dimension: the host is built from it."""

    @property
    @abstractmethod
    def n_classes(self) -> int:
        """Classes for classification, vocabulary size for language modelling."""

    @abstractmethod
    def _build_datasets(self) -> DataSplits:
        """Load or generate ``DataSplits(train, val, test)``; called at most once per module.

        The three must not share samples, and the test split must not depend on ``seed``
        (runs that vary the shuffle are then scored on the very same test samples).
        """

    def setup(self, stage: str | None = None) -> None:
        """Build the tensors once; Lightning calls this per stage, so later calls are no-ops.

        The test split is stored but not looked at (not even its length): a fit calls
        this, and a fit must not read the test split.
        """
        if self._train_set is not None:
            return
        train_set, val_set, test_set = _as_splits(self._build_datasets(), type(self))
        if len(train_set) < self.batch_size:
            raise ConfigError(
                "batch_size",
                f"{self.batch_size} is larger than the train split ({len(train_set)} samples), "
                f"so drop_last would leave no batch; use batch_size <= {len(train_set)} or "
                "more training data",
                type(self),
            )
        self._train_set, self._val_set, self._test_set = train_set, val_set, test_set

    @property
    def train_dataset(self) -> TensorDataset:
        """The train split; built on first access so scripts need not call ``setup`` first."""
        self.setup()
        assert self._train_set is not None
        return self._train_set

    @property
    def val_dataset(self) -> TensorDataset:
        """The validation split; built on first access like ``train_dataset``."""
        self.setup()
        assert self._val_set is not None
        return self._val_set

    @property
    def test_dataset(self) -> TensorDataset:
        """The held-out test split, for evaluation only; nothing in a fit reads it."""
        self.setup()
        assert self._test_set is not None
        return self._test_set

    @property
    def train_size(self) -> int:
        return len(self.train_dataset)

    @property
    def val_size(self) -> int:
        return len(self.val_dataset)

    @property
    def test_size(self) -> int:
        return len(self.test_dataset)

    def train_dataloader(self) -> DataLoader:
        """What Lightning's fit loop iterates: one item per rollout, not host batches.

        Lightning calls ``training_step`` once per item of this loader, and each
        ``training_step`` collects a whole rollout (whose envs read the host batches from
        :meth:`host_train_dataloader` themselves), so one Lightning epoch = one rollout
        and its PPO update, and ``trainer.max_epochs`` counts updates.
        """
        # Its own generator: creating an iterator draws a seed, and drawing it from the global
        # generator would shift the policy's random stream by where Lightning builds it.
        return DataLoader(_RolloutTicks(), batch_size=None, generator=torch.Generator())

    def host_train_dataloader(self) -> DataLoader:
        """Host training batches for ``run_epoch``, shuffled by a generator seeded here.

        Every loader built from one seed replays one order; within one loader the
        generator advances, so an env that keeps its loader sees a new order each epoch.
        """
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader(self.train_dataset, self.batch_size, True, True, generator)

    def host_val_dataloader(self) -> DataLoader:
        """Host validation batches for ``run_epoch``'s fused pass.

        Every validation sample counts, so no shuffle and no dropped tail.
        """
        return self._loader(self.val_dataset, self.val_batch_size, False, False)

    def host_test_dataloader(self) -> DataLoader:
        """Host batches of the held-out test split, for evaluation only.

        Built like :meth:`host_val_dataloader` (every test sample counts, so no shuffle
        and no dropped tail, ``val_batch_size`` per batch); training never calls it.
        """
        return self._loader(self.test_dataset, self.val_batch_size, False, False)

    def _loader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        generator: torch.Generator | None = None,
    ) -> DataLoader:
        """A loader of ``batch_size`` batches; a ``TensorDataset``'s are cut whole.

        Why whole: a loader that fetches a batch sample by sample and stacks them runs a
        Python call per sample, in the thread that draws batches while the CPU worker
        threads train (``esper.tolaria.parallel``), and that Python holds the lock the
        workers share (4.5 ms an epoch of 15 batches of 64 on this project's 2-core VM,
        1.5 ms cut whole). The batches, their order and the generator's draws are those of
        ``DataLoader(shuffle=..., drop_last=..., generator=...)``: the same sampler picks
        the same indices, and gathering those rows copies what stacking them would
        (``tests/tolaria/data/test_loaders.py``). Other datasets load as that does.
        """
        options: dict[str, Any] = {
            "num_workers": self.num_workers,
            "persistent_workers": self.num_workers > 0,
            "pin_memory": torch.cuda.is_available(),
            "generator": generator,
        }
        if type(dataset) is not TensorDataset:
            return DataLoader(
                dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, **options
            )
        order = (
            RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        )
        device = self._resident_device(dataset)
        if device is not None:
            options["pin_memory"] = False  # the rows are gathered on the device already
        # batch_size=None: each item the sampler yields (a batch's index list) is fetched
        # in one _BatchRows[indices], whole tensors.
        return DataLoader(
            _BatchRows(dataset, device),
            batch_size=None,
            sampler=BatchSampler(order, batch_size, drop_last=drop_last),
            **options,
        )

    def _resident_device(self, dataset: TensorDataset) -> torch.device | None:
        """The accelerator ``dataset``'s batches are gathered on (``resident_bytes``), or
        None where they are gathered on the host.

        Why: with the data on the host, every batch of a fit on a GPU is gathered, pinned
        and uploaded by the thread that launches the hosts' kernels. On the H100 that was
        about a tenth of that thread's time in a 16-env update (cProfile: pin_memory 0.08 s
        and index_select 0.05 s of 1.23 s), for a dataset of 12 MB.
        """
        trainer = self.trainer
        if trainer is None or self.num_workers > 0:
            return None
        device = trainer.strategy.root_device
        size = sum(tensor.numel() * tensor.element_size() for tensor in dataset.tensors)
        if device.type == "cpu" or size > self.resident_bytes:
            return None
        return device


class _BatchRows(Dataset):
    """A ``TensorDataset`` read a batch at a time: ``rows[indices]`` gathers each tensor's
    rows at ``indices`` with ``index_select``, on ``device`` where given (the tensors are
    copied there once, the index of each batch without stalling the host:
    ``esper.tolaria.shares.index_on``).

    Why not ``TensorDataset[indices]``: indexing by a Python list takes the general
    advanced-indexing path, 198 us for 64 rows of 3x32x32 on this project's 2-core VM
    against 35 us for ``index_select`` of the same rows (a tensor made from the list
    included). Loading an update's 8 epochs of side_by_side's work (1 000 train images in
    batches of 64, 200 validation images in one batch), one thread: 50.9 ms before, 13.0
    after.
    """

    def __init__(self, dataset: TensorDataset, device: torch.device | None = None) -> None:
        tensors = dataset.tensors
        self.tensors = tensors if device is None else tuple(t.to(device) for t in tensors)
        self._length = len(dataset)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = index_on(self.tensors[0].device, indices)
        return tuple(tensor.index_select(0, index) for tensor in self.tensors)


def _as_splits(built: object, cls: type) -> DataSplits:
    """``built`` as ``DataSplits``: a plain tuple of three datasets is accepted too.

    Anything else (the old ``(train, val)`` pair above all) is a plugin written for an
    older Esper; a TypeError that says what to return beats an unpacking error.
    """
    n_splits = len(DataSplits._fields)
    if (
        isinstance(built, tuple)
        and len(built) == n_splits
        and all(isinstance(part, Dataset) for part in built)
    ):
        return DataSplits(*built)
    got = (
        f"a tuple of {len(built)} ({', '.join(type(part).__name__ for part in built)})"
        if isinstance(built, tuple)
        else type(built).__name__
    )
    raise TypeError(
        f"{cls.__name__}._build_datasets returned {got}; it must return "
        "DataSplits(train, val, test) (esper.tolaria.data.DataSplits), three datasets "
        "with the test split held out from training"
    )


def _recorded(signature: inspect.Signature, arguments: dict[str, Any]) -> dict[str, Any]:
    """Every argument a data module was built with, by name: ``**kwargs`` passed on to
    :class:`HostDataModule` are spread out, and its own defaults fill the rest."""
    recorded = {}
    passed_on: dict[str, Any] = {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            passed_on = dict(value)
        elif name != "self":
            recorded[name] = value
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        base = inspect.signature(HostDataModule.__init__).parameters.values()
        for param in base:
            if param.name != "self" and param.name not in recorded:
                recorded[param.name] = passed_on.pop(param.name, param.default)
        recorded.update(passed_on)  # refused by the base's __init__ anyway
    return recorded
