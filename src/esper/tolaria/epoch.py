"""One host epoch for a batch of envs: train every env, then one fused validation pass
(``esper.tolaria.counterfactual``).

Nothing here reads a tensor's value on the host. Losses, correct counts and the
finite-gradient flags accumulate in device tensors that the caller reads once, in the
step's single packed transfer; sample counts come from shapes, which Python already knows.

Shapes: ``E`` envs, ``S`` slots per host (every env runs the same host architecture).

Its parts live beside it: each env's running sums (``esper.tolaria.accumulators``), the
compiled forward (``esper.tolaria.compiled``), the CPU worker threads
(``esper.tolaria.parallel``), the per-env CUDA streams (``esper.tolaria.streams``) and the
fused validation (``esper.tolaria.counterfactual``).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.incubation import recording_start
from esper.tolaria.accumulators import (
    EnvAccumulator,
    accumulator,
    accumulators,
    epoch_figures,
    seed_grad_norms,
)
from esper.tolaria.compiled import compiled_forward_loss, forward_loss
from esper.tolaria.counterfactual import validate_with_counterfactuals
from esper.tolaria.host_training import HostTraining, autocast_to
from esper.tolaria.parallel import resolve_workers, run_env_steps
from esper.tolaria.shares import by_share_size, consecutive, env_share, group_shares, index_on
from esper.tolaria.stack_grouping import MIN_GROUP, EnvView, stack_groups
from esper.tolaria.stacked import StackedGroup
from esper.tolaria.stacked_validation import validate_stacked
from esper.tolaria.step_graph import GraphedStep, recorder_for
from esper.tolaria.streams import env_streams as _env_streams
from esper.tolaria.streams import on_stream as _on_stream

#: The settings of a plain host epoch: full precision, no compile, every core.
DEFAULT_TRAINING = HostTraining()


class HostOutOfMemoryError(RuntimeError):
    """An env's host ran out of device memory and the policy was to stop."""


@dataclass(frozen=True)
class EpochResult:
    """Per-env figures of one epoch, all device tensors.

    Attributes:
        train_loss: ``[E]`` mean training loss over the epoch's batches.
        train_acc: ``[E]`` fraction of training predictions that were correct.
        val_loss: ``[E]`` mean validation loss with every seed at its own alpha.
        val_acc: ``[E]`` validation accuracy with every seed at its own alpha.
        cf_val_acc: ``[E, S]`` validation accuracy with that slot's alpha forced to 0;
            equal to ``val_acc`` where the slot holds no BLENDING/HOLDING seed, so
            ``val_acc - cf_val_acc`` is each seed's counterfactual contribution.
        loss_finite: ``[E]`` bool, every training loss of the epoch was finite.
        seed_grads_finite: ``[E, S]`` bool, every gradient of that slot's live seed was
            finite (True where the slot trains no seed).
        skipped_envs: envs that ran out of device memory and sat out the rest of this
            epoch's training (``on_oom="skip_env_epoch"``); host-side, known from the
            exception, so nobody reads the device to learn it.
        train_predictions: per env, the predictions its training steps scored (samples,
            or tokens for a language model); host-side, from shapes. Training compute
            (``esper.tolaria.compute``) is counted per prediction.
        stacked_predictions: per env, how many of those it trained in a stacked group
            (``HostTraining.engine="stacked"``); all 0 on the per-env engine. Host-side.
    """

    train_loss: Tensor
    train_acc: Tensor
    val_loss: Tensor
    val_acc: Tensor
    cf_val_acc: Tensor
    loss_finite: Tensor
    seed_grads_finite: Tensor
    skipped_envs: tuple[int, ...] = ()
    train_predictions: tuple[int, ...] = ()
    stacked_predictions: tuple[int, ...] = ()

    @property
    def contribution(self) -> Tensor:
        """``[E, S]`` accuracy each slot's seed adds over its counterfactual."""
        return self.val_acc.unsqueeze(1) - self.cf_val_acc

    def as_dict(self) -> dict[str, Tensor]:
        host_side = ("skipped_envs", "train_predictions", "stacked_predictions")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in host_side}


def run_epoch(
    envs: Sequence[GrowingHost],
    train_batches: Iterable[tuple[Tensor, Tensor]],
    val_batches: Iterable[tuple[Tensor, Tensor]],
    training: HostTraining = DEFAULT_TRAINING,
    scalers: dict[torch.device, torch.amp.GradScaler] | None = None,
    result_device: torch.device | str | None = None,
) -> EpochResult:
    """Train each env for one pass over ``train_batches``, then validate all envs together.

    ``training`` says how (:class:`~esper.tolaria.host_training.HostTraining`: out-of-memory
    policy, compile, autocast, paired groups, CPU worker threads). An env skipped for
    memory (``on_oom="skip_env_epoch"``) has metrics covering the batches it did train
    on. With ``amp="fp16"`` pass ``scalers``, a dict the caller keeps across epochs, which
    gets one ``GradScaler`` per device.

    Envs may live on different devices (round-robin placement over several GPUs): each
    gets the batch copied to its device, trains on its own stream there, and its figures
    are copied device-to-device to ``result_device`` (default: env 0's device).

    Every train batch is split into ``E`` contiguous shares, one per env, so the envs see
    disjoint data and one loader (pinned on CUDA) feeds them all. With ``paired_group=k``
    the envs form groups of ``k`` consecutive envs (``k`` divides ``E``), and every env of a
    group trains on the same share instead (share ``b mod k`` of batch ``b`` split in
    ``k``): each host sees 1/k of the data, and envs of a group that started alike and
    acted alike stay alike, so they differ only by what the policy did
    (``PPOConfig.paired_envs``, ``PPOConfig.pair_size``). On CUDA each env trains on
    its own stream, letting small hosts overlap. Validation iterates ``val_batches`` once;
    each batch goes to every env as ``1 + K`` stacked replicas, where replica ``k > 0``
    runs with the ``k``-th BLENDING/HOLDING seed's alpha at 0, giving all counterfactual
    accuracies from the same pass.

    CPU worker threads (``cpu_workers``) train and validate envs at once; compiled hosts
    and fp16 (one GradScaler shared by a device's envs) stay sequential.
    """
    if not envs:
        raise ValueError("run_epoch needs at least one env")
    on_oom, compile, amp = training.on_oom, training.compile, training.amp
    paired_group = training.paired_group
    slot_ids = envs[0].slot_ids
    for i, env in enumerate(envs):
        if env.slot_ids != slot_ids:
            raise ValueError(
                f"env {i} has slots {list(env.slot_ids)} but env 0 has {list(slot_ids)}; "
                "all envs of one run must use the same host architecture"
            )
    if paired_group is not None and len(envs) % paired_group:
        raise ValueError(f"paired_group={paired_group} must divide the {len(envs)} envs")
    device = envs[0].device if result_device is None else torch.device(result_device)
    if amp == "fp16":
        scalers = {} if scalers is None else scalers
        for env in envs:
            scalers.setdefault(env.device, torch.amp.GradScaler(env.device.type))
    options = _Options(
        on_oom=on_oom,
        forward_loss=compiled_forward_loss() if compile else forward_loss,
        amp_dtype=training.amp_dtype,
        scalers=scalers if amp == "fp16" else None,
        paired_group=paired_group,
        compiled=compile,
        cuda_graphs=training.cuda_graphs,
    )
    workers = resolve_workers(training.cpu_workers, len(envs))
    stacked = training.stacks(env.device for env in envs)
    cpu_only = all(e.device.type == "cpu" for e in envs)
    if workers > 1 and not stacked and not compile and amp != "fp16" and cpu_only:
        train, (val_loss, val_acc, cf_acc) = _train_and_validate_in_workers(
            envs, train_batches, val_batches, options, workers, device
        )
    else:
        train, groups = _train(envs, train_batches, options, stacked)
        try:
            if stacked:
                val_loss, val_acc, cf_acc = validate_stacked(envs, groups, val_batches, device)
            else:
                val_loss, val_acc, cf_acc = validate_with_counterfactuals(envs, val_batches, device)
        finally:
            for group in groups:  # validated from its stacked tensors: now the envs get them
                group.write_back()
    for i, acc in enumerate(train):
        if acc.seen == 0 and not acc.skipped:
            raise ValueError(
                f"env {i} received no training samples this epoch; the train loader must "
                f"yield at least one batch of at least {len(envs)} samples (one per env)"
            )

    train_loss, train_acc, loss_finite, seed_grads_finite = epoch_figures(train, device)
    return EpochResult(
        train_loss=train_loss,
        train_acc=train_acc,
        val_loss=val_loss,
        val_acc=val_acc,
        cf_val_acc=cf_acc,
        loss_finite=loss_finite,
        seed_grads_finite=seed_grads_finite,
        skipped_envs=tuple(i for i, a in enumerate(train) if a.skipped),
        train_predictions=tuple(a.seen for a in train),
        stacked_predictions=tuple(a.seen_stacked for a in train),
    )


# --------------------------------------------------------------------------- train
@dataclass(frozen=True)
class _Options:
    on_oom: str
    forward_loss: Callable[[HostModel, Tensor, Tensor], tuple[Tensor, Tensor]]
    amp_dtype: torch.dtype | None
    scalers: dict[torch.device, torch.amp.GradScaler] | None
    paired_group: int | None = None
    compiled: bool = False
    #: Steps, stacked and per-env, are recorded as CUDA graphs where the device records
    #: (``esper.tolaria.step_graph``); ``HostTraining`` refuses it with compile or fp16.
    cuda_graphs: bool = False


def _train(
    envs: Sequence[GrowingHost],
    batches: Iterable[tuple[Tensor, Tensor]],
    options: _Options,
    stacked: bool = False,
) -> tuple[list[EnvAccumulator], list[StackedGroup]]:
    """The envs' accumulators, and the stacked groups that trained the epoch through, not
    yet written back (``_train_batches``)."""
    accs = accumulators(envs)
    for env in envs:
        env.model.train()
    streams = _env_streams(envs)
    # Callers may hold a no-grad context (the rollout loop does); host training needs grads.
    try:
        with torch.enable_grad():
            groups = _train_batches(envs, accs, batches, streams, options, stacked)
    finally:
        for acc in accs:  # a recorded step refers back to its accumulator: let it go now
            acc.graphed = None
    return accs, groups


#: Each CPU env's last validation in the worker threads, in seconds: how long its next
#: one is expected to take, so that the workers train first the envs whose validation is
#: long (``esper.tolaria.parallel``). Kept beside the hosts, not in them: it only orders
#: the work. Keyed weakly, so an episode's hosts leave with it.
_validation_seconds: weakref.WeakKeyDictionary[GrowingHost, float] = weakref.WeakKeyDictionary()


def _train_and_validate_in_workers(
    envs: Sequence[GrowingHost],
    train_batches: Iterable[tuple[Tensor, Tensor]],
    val_batches: Iterable[tuple[Tensor, Tensor]],
    options: _Options,
    workers: int,
    device: torch.device,
) -> tuple[list[EnvAccumulator], tuple[Tensor, Tensor, Tensor]]:
    """CPU envs in ``workers`` threads, a training step at a time, each env validated
    once it has trained on every batch (``esper.tolaria.parallel.run_env_steps``)."""
    accs = accumulators(envs)
    for env in envs:
        env.model.train()

    def step(i: int, b: int, batch: tuple[Tensor, Tensor]) -> None:
        with torch.enable_grad():  # grad mode is per thread
            _train_env_on_batch(envs, accs, i, b, batch, None, options)

    seconds: list[float | None] = [None] * len(envs)  # each worker writes its env's own

    def finish(i: int, val: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        tick = time.perf_counter()  # a CPU env: its ops are done when they return
        figures = validate_with_counterfactuals([envs[i]], val, device)
        seconds[i] = time.perf_counter() - tick
        return figures

    expected = [_validation_seconds.get(env) for env in envs]
    parts = run_env_steps(
        len(envs), workers, train_batches, lambda: list(val_batches), step, finish, expected
    )
    for env, took in zip(envs, seconds, strict=True):
        if took is not None:
            _validation_seconds[env] = took
    val_loss, val_acc, cf_acc = (torch.cat([p[k] for p in parts]) for k in range(3))
    return accs, (val_loss, val_acc, cf_acc)


def _train_batches(
    envs: Sequence[GrowingHost],
    accs: list[EnvAccumulator],
    batches: Iterable[tuple[Tensor, Tensor]],
    streams: list[torch.cuda.Stream | None],
    options: _Options,
    stacked: bool,
) -> list[StackedGroup]:
    """Train every env on its share of every batch, one batch at a time: with
    ``stacked``, envs that share an architecture as groups (``esper.tolaria.stacked``),
    the others, or all, on their own. Returns the groups that trained the epoch through,
    not yet written back: they validate from their stacked tensors
    (``esper.tolaria.stacked_validation``), then the caller writes them back.

    Groups are split where their members' shares of the first batch differ in size
    (a batch that does not split evenly over the envs: ``esper.tolaria.shares.by_share_size``),
    so that every batch of that size trains them stacked. A group whose members' shares
    of a later batch differ in size (a loader's shorter last batch) is written back and its
    members train on that batch alone; one that runs out of memory is written back and
    its members finish the epoch alone (the per-env path applies ``on_oom``), starting
    with the batch it failed on: the failed step leaves the group as it found it
    (``StackedGroup.step``), so that batch counts once.
    """
    members: list[list[int]] = []
    alone = list(range(len(envs)))
    views: list[EnvView] = []
    batches = iter(batches)
    first = next(batches, None)
    if stacked and first is not None:
        views = [EnvView.of(env) for env in envs]  # one walk of each host, for both
        members, alone = stack_groups(envs, views)
        size = first[0].shape[0]
        members, apart = by_share_size(members, size, len(envs), options.paired_group, MIN_GROUP)
        alone = sorted(alone + apart)
    groups = [
        StackedGroup(
            [envs[i] for i in g],
            [accs[i] for i in g],
            [views[i] for i in g],
            graphs=options.cuda_graphs,
        )
        for g in members
    ]
    env_devices = [env.device for env in envs]  # a parameter lookup each: once an epoch
    #: Per group, its members' rows of an evenly split batch, where they are not one
    #: slice: gathered by one index, made once on the group's device.
    rows = [None if consecutive(g) else index_on(env_devices[g[0]], g) for g in members]
    #: Groups that ran out of memory: their members finish the epoch on their own.
    split: set[int] = set()
    for b, (x_cpu, y_cpu) in enumerate(itertools.chain(() if first is None else [first], batches)):
        # One copy of the batch per device the envs live on (round-robin placement).
        copies = {
            d: (x_cpu.to(d, non_blocking=True), y_cpu.to(d, non_blocking=True))
            for d in set(env_devices)
        }
        on_own = list(alone)
        for g, (group, indices) in enumerate(zip(groups, members, strict=True)):
            device = env_devices[indices[0]]
            shares = None
            if g not in split:
                shares = group_shares(
                    copies[device], b, indices, rows[g], len(envs), options.paired_group
                )
            if shares is not None:
                if shares[1].shape[1] == 0:  # a short last batch: no rows for them, no step,
                    continue  # as each would skip its own empty share
                try:
                    group.step(*shares, options.amp_dtype)
                    continue
                except torch.OutOfMemoryError:
                    split.add(g)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            group.write_back()
            on_own += indices
        for i in sorted(on_own):
            _train_env_on_batch(envs, accs, i, b, copies[env_devices[i]], streams[i], options)
    for device, stream in zip(env_devices, streams, strict=True):
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
    return [group for g, group in enumerate(groups) if g not in split]


def _train_env_on_batch(
    envs: Sequence[GrowingHost],
    accs: list[EnvAccumulator],
    i: int,
    b: int,
    batch: tuple[Tensor, Tensor],
    stream: torch.cuda.Stream | None,
    options: _Options,
) -> None:
    """Env ``i``'s step on its share of batch ``b`` (already on its device)."""
    env, acc = envs[i], accs[i]
    xe, ye = env_share(batch, b, i, len(envs), options.paired_group)
    if xe.shape[0] == 0 or acc.skipped:
        return
    try:
        with _on_stream(stream, xe.device, (xe, ye)):
            _train_step(env, acc, xe, ye, options)
    except torch.OutOfMemoryError as exc:
        if options.on_oom == "raise":
            raise HostOutOfMemoryError(
                f"env {i} ran out of device memory while training its host on a "
                f"share of {xe.shape[0]} samples; lower data.batch_size or "
                "model.n_envs, or set model.on_oom=skip_env_epoch to let that env "
                f"sit out the epoch ({exc})"
            ) from exc
        acc.skipped = True
        env.zero_grad()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


def train_step(env: GrowingHost, x: Tensor, y: Tensor) -> None:
    """One training step of one env on one batch, as ``run_epoch`` takes it (eager, full
    precision): the host's step, and the incubation pass of any seed in TRAINING."""
    env.model.train()
    with torch.enable_grad():  # callers may hold a no-grad context (the rollout loop does)
        _train_step(env, accumulator(env), x, y, _Options("raise", forward_loss, None, None))


def _train_step(
    env: GrowingHost, acc: EnvAccumulator, x: Tensor, y: Tensor, options: _Options
) -> None:
    env.model.check_input(x)  # host-side shape check, outside any compiled graph
    graphed = _graphed(env, acc, options)
    if graphed is None:
        loss, correct, norms = _device_train_step(env, acc, x, y, options)
        acc.pending_norms.extend(norms)
    else:
        # Where it replayed, this step's outputs are in the graph's memory, which the next
        # replay overwrites, so the epoch keeps copies (``esper.tolaria.step_graph``).
        x, y, outputs = graphed(x, y)
        loss, correct, stacked_norms = (t.clone() for t in outputs)
        if acc.seed_params:
            acc.pending_norm_rows.append(stacked_norms)
    acc.keep_step(loss, correct, y.numel())
    env.probe = (x, y)  # a reference: what a widening seed planted next ranks units on


def _graphed(
    env: GrowingHost, acc: EnvAccumulator, options: _Options
) -> GraphedStep[tuple[Tensor, Tensor, Tensor]] | None:
    """``acc``'s step recorded as a CUDA graph for the epoch, where asked and ``env``'s
    device records (None: its steps run as they are)."""
    if not options.cuda_graphs:
        return None
    if acc.graphed is None:
        recorder = recorder_for(env.device)
        if recorder is None:
            return None

        def step(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            loss, correct, norms = _device_train_step(env, acc, x, y, options)
            # One tensor of norms, one copy a step (none trained: the loss stands in).
            return loss, correct, torch.stack(norms) if norms else loss

        acc.graphed = GraphedStep(step, recorder)
    return acc.graphed


def _device_train_step(
    env: GrowingHost, acc: EnvAccumulator, x: Tensor, y: Tensor, options: _Options
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """One env's step on its device: its detached loss, correct count and seed-gradient
    norms (:func:`seed_grad_norms`), the loss already summed into ``acc``. Nothing here
    reads the device on the host (an fp16 scaler's step aside, which is never recorded)."""
    env.zero_grad()
    autocast = autocast_to(x.device.type, options.amp_dtype, cache=not options.cuda_graphs)
    incubation = acc.incubation
    # A compiled forward keeps its graph: no hook to record where incubation starts.
    recorded = [] if options.compiled or incubation is None else incubation.slots
    with autocast, recording_start(env.model, recorded) as start:
        loss, correct = options.forward_loss(env.model, x, y)
    count = y.numel()
    scaler = options.scalers.get(x.device) if options.scalers is not None else None
    (loss if scaler is None else scaler.scale(loss)).backward()
    if incubation is not None:
        # TRAINING seeds learn from their own pass; it adds gradients to them alone.
        with autocast:
            seed_loss = incubation.loss(x, y, start)
        (seed_loss if scaler is None else scaler.scale(seed_loss)).backward()
    if scaler is None:
        norms = seed_grad_norms(acc)
        env.step()
    else:
        # fp16: one GradScaler per device. Its step() reads the overflow flag on the host
        # (torch's design); bf16 needs no scaler and reads nothing.
        optimizers = env.optimizers()
        for opt in optimizers:
            scaler.unscale_(opt)
        norms = seed_grad_norms(acc)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
    loss = loss.detach()
    acc.add_loss(loss, count)
    return loss, correct, norms
