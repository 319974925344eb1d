"""``benchmarks/rollout.py --overhead``: wall time of PPO updates as training runs them
against the pure host compute of the same work, in the same process.

Each case runs ``Trainer.fit`` of a :class:`PPOModule` with the default callbacks of
``esper fit`` (telemetry, governor, timeline, best and last checkpoint; TensorBoard
logger; no progress bar) and times every update from ``on_train_epoch_start`` to the end
of ``on_train_epoch_end`` (rollout, PPO update, logging, checkpoints). Right before each
host epoch of a timed update it deep-copies every env's host (model and optimizers) twice
and times, on those copies, the two figures the wall is compared with; the copies and
these measurements are subtracted from that update's wall. The pure host compute trains
one set of copies on the same pre-collated batches (the epoch's shares of the host train
loader, collated once beforehand), with forward, loss, the incubation pass of TRAINING
seeds, backward and optimiser steps, then a plain forward over the pre-collated
validation batches: no policy, no snapshots, no counterfactual replicas, no telemetry, no
accumulators. With ``cpu_workers > 1`` the pure compute runs in as many threads, each
env's ops on one intra-op thread, handed out a step at a time as ``run_epoch`` hands them
out (``esper.tolaria.parallel.run_env_steps``). ``run_epoch s`` runs ``run_epoch`` itself
on the other copies with the same pre-collated batches: what it adds to the pure compute
is counterfactual replicas and bookkeeping; what the wall adds to it is the policy, PPO,
snapshots, loader and callbacks. The two alternate which goes first from epoch to epoch.
Three columns split the wall itself, timed in the fit: ``host epochs s``, its host epochs
as training ran them (``run_epoch`` with the loader), ``update s``, from the end of the
rollout's hooks to the end of the PPO update's (the PPO update, its logging and hooks),
and ``rest s``, each update's wall less both: the policy's acts, lifecycle ops,
snapshots, rollout hooks and the epoch's end (logging, checkpoints).

Why beside each epoch rather than after the fit: this VM's speed drifts by up to 20%
within the hour, and figures taken a minute apart moved the ratio by more than the
overheads it measures (on the same recorded hosts, run_epoch after the fit came out
0.25-0.39 s per update faster than the same epochs in the fit at 2 threads and 0.21-0.35 s
slower at 1 thread; taken beside each epoch, the in-fit epoch cost 3-15 ms more).

``--wall-only`` times the fits' updates alone (:class:`_WallTimer`): no copies, no
figures beside the epochs, whose deep copies and extra training would otherwise run
between the timed epochs of both thread counts. It gives the thread counts' ratio
(issue 16, item 3) and the split of the wall from undisturbed updates, at half the time
per fit.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from esper.callbacks import CALLBACKS
from esper.callbacks.base import EsperCallback
from esper.callbacks.checkpoint import EsperCheckpointIO
from esper.cli.options import DEFAULT_CALLBACKS
from esper.contracts.rollout import RolloutSummary
from esper.kasmina import GrowingHost
from esper.kasmina.incubation import IncubationPass, incubating_slots, recording_start
from esper.simic.module import DEFAULT_HOST_KWARGS, PPOModule
from esper.tolaria.data import DATAMODULES
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import HostTraining
from esper.tolaria.parallel import resolve_workers, run_env_steps
from esper.tolaria.shares import env_share

#: The two hosts of issue 16: esper-lite's (6 418 parameters on 3x32x32) and esper's default.
HOSTS: dict[str, dict[str, Any]] = {
    "predecessor": {"channels": [8, 16, 32], "convs_per_stage": 1},
    "default": dict(DEFAULT_HOST_KWARGS["cnn"]),
}
Batch = tuple[Tensor, Tensor]
#: Images each env trains on per step (issue 16's work).
IMAGES_PER_ENV_STEP = 16


class _UpdateTimer(EsperCallback):
    """Times each update and, beside each of its host epochs, the pure host compute and
    ``run_epoch`` of copies of that epoch's hosts; copies and their timing are excluded.

    Each update's wall is split too: its host epochs as the fit ran them (``run_epoch``
    with the loader, counterfactual replicas and bookkeeping), and its *update*, from the
    end of the rollout's hooks to the end of the PPO update's (the PPO update, its
    logging and the callbacks' update hooks); the rest is the policy's acts, lifecycle
    ops, snapshots, rollout hooks and the epoch's end (logging, checkpoints).
    """

    #: Whether the pure and run_epoch figures are timed on copies beside each epoch.
    times_copies = True

    def __init__(self, warmup: int, data: Any, workers: int, group: int | None) -> None:
        self.warmup = warmup
        self.data, self.workers, self.group = data, workers, group
        #: Per timed update: its wall, and the pure and run_epoch seconds of its epochs.
        self.seconds: list[float] = []
        self.pure: list[float] = []
        self.run_epoch: list[float] = []
        #: Per timed update: seconds of its host epochs in the fit, and of its PPO update.
        self.host_epochs: list[float] = []
        self.update: list[float] = []
        self._batches: tuple[list[Batch], list[Batch]] | None = None
        self._epochs = 0
        self._excluded = 0.0
        self._start = 0.0
        self._update_start = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, module: PPOModule) -> None:
        env = module.env
        assert env is not None
        if trainer.current_epoch == self.warmup:
            original = env.train_epoch

            def measured() -> object:
                tick = time.perf_counter()
                self._measure_copies(env.hosts, pure_first=self._epochs % 2 == 0)
                self._epochs += 1
                start = time.perf_counter()
                self._excluded += start - tick
                result = original()
                self.host_epochs[-1] += time.perf_counter() - start
                return result

            env.train_epoch = measured  # type: ignore[method-assign]
        if trainer.current_epoch >= self.warmup:
            self.pure.append(0.0)
            self.run_epoch.append(0.0)
            self.host_epochs.append(0.0)
            self.update.append(0.0)
        self._excluded = 0.0
        self._start = time.perf_counter()

    def on_rollout_end(
        self, trainer: L.Trainer, module: PPOModule, rollout: RolloutSummary
    ) -> None:
        self._update_start = time.perf_counter()

    def on_ppo_update_end(
        self, trainer: L.Trainer, module: PPOModule, metrics: dict[str, float]
    ) -> None:
        if trainer.current_epoch >= self.warmup:
            self.update[-1] = time.perf_counter() - self._update_start

    def on_train_epoch_end(self, trainer: L.Trainer, module: PPOModule) -> None:
        if trainer.current_epoch >= self.warmup:
            self.seconds.append(time.perf_counter() - self._start - self._excluded)

    def medians(self) -> dict[str, float]:
        """The case's figures: median wall, host epochs, update, rest (the median of each
        update's wall less its epochs and update), pure and run_epoch seconds per update,
        the median of each update's own wall / pure (nan where copies are not timed), and
        the workers and paired group."""
        median = statistics.median
        if self.times_copies:
            pure, run_epoch_s = median(self.pure), median(self.run_epoch)
            pairs = zip(self.seconds, self.pure, strict=True)
            ratio = median(w / p for w, p in pairs)
        else:
            pure = run_epoch_s = ratio = float("nan")
        parts = zip(self.seconds, self.host_epochs, self.update, strict=True)
        return {
            "wall": median(self.seconds),
            "host_epochs": median(self.host_epochs),
            "update": median(self.update),
            # Each update's own rest: medians of wall and parts taken apart would not add up.
            "rest": median(w - e - u for w, e, u in parts),
            "pure": pure,
            "run_epoch": run_epoch_s,
            "ratio": ratio,
            "workers": self.workers,
            "group": self.group,
        }

    def batches(self) -> tuple[list[Batch], list[Batch]]:
        """The host train and validation batches, collated once; the run's random streams
        are left as they were (iterating a loader draws its base seed from them)."""
        if self._batches is None:
            with torch.random.fork_rng():
                self._batches = (
                    list(self.data.host_train_dataloader()),
                    list(self.data.host_val_dataloader()),
                )
        return self._batches

    def _measure_copies(self, hosts: list[GrowingHost], pure_first: bool) -> None:
        """Pure compute and ``run_epoch`` of this epoch on copies of ``hosts``, leaving the
        run's hosts and random streams as they were."""
        train, val = self.batches()
        figures = [
            (self.pure, pure_host_compute, copy.deepcopy(hosts)),
            (self.run_epoch, run_epoch_compute, copy.deepcopy(hosts)),
        ]
        with torch.random.fork_rng():
            for into, compute, copies in figures if pure_first else figures[::-1]:
                into[-1] += compute([copies], train, val, self.workers, self.group)


def incubation_of(host: GrowingHost) -> IncubationPass | None:
    """The host's seed-only pass for one epoch, built once as ``run_epoch`` builds it
    (None: no seed in TRAINING)."""
    slots = incubating_slots(host.model)
    return IncubationPass(host.model, slots) if slots else None


class _WallTimer(_UpdateTimer):
    """Times each update and nothing beside it: pure and run_epoch are not measured."""

    times_copies = False

    def _measure_copies(self, hosts: list[GrowingHost], pure_first: bool) -> None:
        return


def _pure_step(
    host: GrowingHost,
    incubation: IncubationPass | None,
    i: int,
    n: int,
    b: int,
    batch: Batch,
    group: int | None,
) -> None:
    """Env ``i`` of ``n`` trains on its share of batch ``b``: compute only."""
    xe, ye = env_share(batch, b, i, n, group)
    model = host.model
    with torch.enable_grad():
        host.zero_grad()
        slots = [] if incubation is None else incubation.slots
        with recording_start(model, slots) as start:
            loss = model.loss_and_correct(model(xe), ye)[0]
        loss.backward()
        if incubation is not None:
            incubation.loss(xe, ye, start).backward()
        host.step()


@torch.no_grad()
def _pure_val(host: GrowingHost, val: list[Batch]) -> None:
    """A plain forward of the validation batches: no counterfactual replicas."""
    model = host.model
    model.eval()
    for x, y in val:
        model.loss_and_correct(model(x), y)
    model.train()


def train_share(
    hosts: list[GrowingHost],
    envs: Sequence[int],
    train: list[Batch],
    val: list[Batch],
    group: int | None,
) -> None:
    """Envs ``envs`` of one epoch's ``hosts`` train, one after another per batch, then
    validate: the pure compute in one thread."""
    n = len(hosts)
    passes = {i: incubation_of(hosts[i]) for i in envs}
    for i in envs:
        hosts[i].model.train()
    for b, batch in enumerate(train):
        for i in envs:
            _pure_step(hosts[i], passes[i], i, n, b, batch, group)
    for i in envs:
        _pure_val(hosts[i], val)


def _pure_epoch_in_workers(
    hosts: list[GrowingHost], train: list[Batch], val: list[Batch], workers: int, group: int | None
) -> None:
    n = len(hosts)
    passes = [incubation_of(host) for host in hosts]
    for host in hosts:
        host.model.train()

    def step(i: int, b: int, batch: Batch) -> None:
        _pure_step(hosts[i], passes[i], i, n, b, batch, group)

    def finish(i: int, batches: list[Batch]) -> None:
        _pure_val(hosts[i], batches)

    run_env_steps(n, workers, train, lambda: val, step, finish)


def pure_host_compute(
    update: list[list[GrowingHost]],
    train: list[Batch],
    val: list[Batch],
    workers: int,
    group: int | None,
) -> float:
    """Seconds to train and validate one update's recorded hosts (the copies are trained)
    on the shares training gave them (``group``: the paired group, or None); with
    ``workers > 1`` in as many threads, scheduled a step at a time as ``run_epoch`` does."""
    n = len(update[0])
    start = time.perf_counter()
    for hosts in update:
        if workers == 1:
            train_share(hosts, range(n), train, val, group)
        else:
            _pure_epoch_in_workers(hosts, train, val, workers, group)
    return time.perf_counter() - start


def run_epoch_compute(
    update: list[list[GrowingHost]],
    train: list[Batch],
    val: list[Batch],
    workers: int,
    group: int | None,
) -> float:
    """Seconds ``run_epoch`` takes for the same hosts and batches: the pure compute plus
    counterfactual replicas, accumulators, gradient flags and the workers' hand-off."""
    start = time.perf_counter()
    for epoch in update:
        run_epoch(epoch, train, val, HostTraining(paired_group=group, cpu_workers=workers))
    return time.perf_counter() - start


def fit_case(
    host: str,
    n_envs: int,
    episode_epochs: int,
    updates: int,
    warmup: int,
    seed: int,
    cpu_workers: int | None = None,
    timer_class: type[_UpdateTimer] | None = None,
) -> _UpdateTimer:
    """One case's ``Trainer.fit`` with ``timer_class`` (default :class:`_UpdateTimer`)
    watching it; returns the timer."""
    L.seed_everything(seed, verbose=False)
    module = PPOModule(n_envs=n_envs, episode_epochs=episode_epochs, host_kwargs=HOSTS[host])
    module.env_config = replace(module.env_config, cpu_workers=cpu_workers)
    # Paired envs (the default) train every env of a group on the same share of a batch:
    # the batch holds one share per group member, so each env still gets 16 images a step.
    ppo = module.ppo_config
    group = replace(module.env_config, pairing=ppo.pairing).paired_group
    data = DATAMODULES.get("synthetic")(
        input_shape=[3, 32, 32],
        n_classes=10,
        n_train=1000,
        n_val=200,
        batch_size=IMAGES_PER_ENV_STEP * (group or n_envs),
    )
    workers = resolve_workers(module.env_config.cpu_workers, n_envs)
    timer = (timer_class or _UpdateTimer)(warmup, data, workers, group)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            default_root_dir=tmp,
            max_epochs=warmup + updates,
            logger=TensorBoardLogger(tmp),
            callbacks=[*(CALLBACKS.get(name)() for name in DEFAULT_CALLBACKS), timer],
            plugins=[EsperCheckpointIO()],
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=1,
        )
        trainer.fit(module, datamodule=data)
    assert module.env is not None and module.env.config.paired_group == group
    return timer


#: The figures of a case's rounds that :func:`summarise` takes the median of.
FIGURES = ("wall", "host_epochs", "update", "rest", "run_epoch", "pure", "ratio")


def summarise(runs: list[dict[str, float]], first: list[dict[str, float]]) -> dict[str, float]:
    """One row from a case's rounds at one thread count: the median of each of
    :data:`FIGURES` over the rounds (each round's ratio is the median of its updates' own
    wall / pure), and ``vs_first``, the median over rounds of this round's wall over the
    same round's wall at the first thread count (``first``)."""
    row = {k: statistics.median(m[k] for m in runs) for k in FIGURES}
    row["vs_first"] = statistics.median(
        m["wall"] / f["wall"] for m, f in zip(runs, first, strict=True)
    )
    return row


def print_overhead(
    n_envs: list[int],
    episode_epochs: int,
    updates: int,
    warmup: int,
    hosts: list[str] | None = None,
    threads: list[int] | None = None,
    cpu_workers: int | None = None,
    rounds: int = 1,
    wall_only: bool = False,
) -> None:
    """Every case at one torch thread and at the process's default, one after the other,
    so that both settings meet the same load on a shared machine. With ``rounds > 1`` the
    thread counts alternate that many times per case; each row gives the medians over the
    rounds, and ``wall / 1 thread`` the median of each round's own ratio (adjacent fits,
    so a machine whose speed drifts within the hour moves both sides of it alike). With
    ``wall_only`` the updates are timed alone (:class:`_WallTimer`; the other columns
    print as nan)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    default_threads = torch.get_num_threads()
    counts = list(dict.fromkeys(threads or (1, default_threads)))
    print(
        f"overhead: synthetic 3x32x32, 10 classes, 1000 train / 200 val, "
        f"{IMAGES_PER_ENV_STEP} images per env per step (batch {IMAGES_PER_ENV_STEP} x paired "
        f"group, or x n_envs unpaired), episode_epochs={episode_epochs}, "
        f"{updates} timed updates after {warmup} "
        f"warm-up, torch threads {counts} (torch.set_num_threads) in turn, "
        f"{rounds} round(s), cpu_workers={cpu_workers}"
        + (", updates timed alone (no pure or run_epoch figures)" if wall_only else "")
    )
    timer_class = _WallTimer if wall_only else _UpdateTimer
    print(
        f"{'host':>11} | {'n_envs':>6} | {'threads':>7} | {'workers':>7} | "
        f"{'wall s/update':>13} | {'host epochs s':>13} | {'update s':>8} | {'rest s':>6} | "
        f"{'run_epoch s':>11} | {'pure host s':>11} | {'ratio':>5} | {'wall / 1 thread':>15}"
    )
    for host in hosts or list(HOSTS):
        for n in n_envs:
            cases: dict[int, list[dict[str, float]]] = {count: [] for count in counts}
            for _ in range(rounds):
                for count in counts:
                    torch.set_num_threads(count)
                    timer = fit_case(
                        host, n, episode_epochs, updates, warmup, 0, cpu_workers, timer_class
                    )
                    cases[count].append(timer.medians())
            torch.set_num_threads(default_threads)
            for count, runs in cases.items():
                row = summarise(runs, cases[counts[0]])
                print(
                    f"{host:>11} | {n:>6} | {count:>7} | {runs[0]['workers']:>7} | "
                    f"{row['wall']:>13.3f} | {row['host_epochs']:>13.3f} | {row['update']:>8.3f} | "
                    f"{row['rest']:>6.3f} | "
                    f"{row['run_epoch']:>11.3f} | {row['pure']:>11.3f} | "
                    f"{row['ratio']:>5.3f} | {row['vs_first']:>15.3f}",
                    flush=True,
                )
            if rounds > 1:
                first = cases[counts[0]]
                for count in counts[1:]:
                    each = " ".join(
                        f"{m['wall'] / f['wall']:.3f}"
                        for m, f in zip(cases[count], first, strict=True)
                    )
                    print(f"{'':>11}   {count} threads, each round's wall / {counts[0]}: {each}")
