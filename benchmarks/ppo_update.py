"""What one PPO update costs: seconds and kernel-launching operators, per replay path.

The update replays every minibatch's recurrent states (``PolicyNetwork.evaluate``).
A rollout is one episode an env, so its chains of states break only where a governor
restore broke them; the buffer lists where (``PPOBatch.breaks``), and the LSTM replays the
stretches between in one fused call. A batch that lists nothing steps through in Python,
a cell, a reset and two stacks a step. This collects one real rollout
(``benchmarks/rollout.py``'s collector: digits, the default CNN host, a fresh policy,
``--episode-epochs`` host epochs) and times ``ppo_update`` with the default ``PPOConfig``
on it three ways, on the same batch and from the same policy:

- *one call*: the batch as the buffer made it;
- *one call, restores*: as if a restore had hit every fourth env halfway (:func:`restored`);
- *step loop*: the batch with ``breaks=None``.

Seconds are the median over ``--repeats`` updates after one warm-up, on ``--threads``
intra-op threads; kernel ops are counted in one more update (``dispatch.py``'s
``KernelOps``: every aten operator that launches a kernel, ``launch_rule``),
the launches a launch-bound GPU pays for, whatever machine counts them.

``--recorded`` adds each path with its minibatch passes recorded and replayed
(``esper.simic.ppo_graph``, what ``cuda_graphs`` turns on): one policy and one recording
over the warm-up and the timed updates, as in a run, where the recording serves every
update; a replay counts as one launch. On a CUDA device the recorder is a CUDA graph's;
on a CPU, ``--tape`` takes the tests' tape recorder (``tests/tolaria/op_tape.py``), which
runs each replay operator by operator: its seconds say nothing, its count of what is
left to launch is the GPU's.

Usage: ``python benchmarks/ppo_update.py [--n-envs 4 16] [--episode-epochs 25]
[--repeats 5] [--threads 1] [--device cpu] [--recorded [--tape]]``
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from dispatch import KernelOps
from rollout import build, synchronize
from torch.utils._python_dispatch import _disable_current_modes

from esper.simic.ppo import PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_batch import PPOBatch
from esper.simic.ppo_graph import RecordedMinibatches
from esper.tolaria.step_graph import Recorder, own_recorder


def restored(batch: PPOBatch) -> PPOBatch:
    """``batch`` as a governor restore of every fourth env halfway through leaves it: the
    kept step and the next flagged restarts, and listed among the breaks. Each acts from
    its stored state, which here is the state it acted from anyway, so every replay of
    this batch computes the same figures; only the replay's work differs."""
    assert batch.breaks is not None  # the buffer lists them
    hit, half = range(0, batch.n_envs, 4), batch.obs.shape[1] // 2
    cuts = [t for t in (half, half + 1) if 0 < t < batch.obs.shape[1]]
    restarts = batch.hidden_restarts.clone()
    restarts[list(hit), half : half + len(cuts)] = True
    breaks = tuple(
        tuple(sorted({*mine, *cuts})) if e in hit else mine for e, mine in enumerate(batch.breaks)
    )
    return dataclasses.replace(batch, hidden_restarts=restarts, breaks=breaks)


#: The replay paths: what each makes of the collected batch.
PATHS: dict[str, Callable[[PPOBatch], PPOBatch]] = {
    "one call": lambda batch: batch,
    "one call, restores": restored,
    "step loop": lambda batch: dataclasses.replace(batch, breaks=None),
}


def measure(
    batch: PPOBatch,
    policy: torch.nn.Module,
    repeats: int,
    device: torch.device,
    recorder: Recorder | None = None,
) -> tuple[float, int]:
    """Median seconds of ``repeats`` updates and the kernel ops of one, each update from a
    copy of ``policy`` with a fresh optimizer, on ``batch``; with ``recorder``, its
    minibatches recorded and replayed, all updates from one copy (:func:`measure_recorded`)."""
    config = PPOConfig()
    if recorder is not None:
        return measure_recorded(batch, copy.deepcopy(policy), repeats, device, recorder)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        copied = copy.deepcopy(policy)
        return copied, make_optimizer(copied, config)

    ppo_update(*fresh(), batch, config)  # warm-up: allocator, oneDNN and cuDNN plans
    seconds = []
    for _ in range(repeats):
        model, optimizer = fresh()
        synchronize(device)
        start = time.perf_counter()
        ppo_update(model, optimizer, batch, config)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    model, optimizer = fresh()
    ops = KernelOps()
    with ops:
        ppo_update(model, optimizer, batch, config)
    return statistics.median(seconds), sum(ops.counts.values())


def measure_recorded(
    batch: PPOBatch,
    policy: torch.nn.Module,
    repeats: int,
    device: torch.device,
    recorder: Recorder,
) -> tuple[float, int]:
    """:func:`measure` with the minibatch passes recorded: one policy, one optimizer and
    one recording for the warm-up (which records) and every later update, as a run has;
    the kernel ops of the last update count each replay as one launch."""
    config = PPOConfig()
    optimizer = make_optimizer(policy, config)
    passes = RecordedMinibatches(policy, config, recorder)  # type: ignore[arg-type]

    def update() -> None:
        ppo_update(policy, optimizer, batch, config, minibatch_passes=passes)

    update()  # warm-up: records
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        update()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    replays = sum(step.replays for step in passes.steps)
    ops = KernelOps()
    with ops:
        update()
    replayed = sum(step.replays for step in passes.steps) - replays
    return statistics.median(seconds), sum(ops.counts.values()) + replayed


def tape_recorder() -> Recorder:
    """The tests' tape recorder, its replays hidden from ``KernelOps`` (the count adds
    one launch a replay, as a CUDA graph's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tolaria.op_tape import TapeRecorder

    class UncountedTape(TapeRecorder):
        def record(self, step: Callable[[], None]) -> Callable[[], None]:
            replay = super().record(step)

            def hidden() -> None:
                with _disable_current_modes():
                    replay()

            return hidden

    return UncountedTape(torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--episode-epochs", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--recorded", action="store_true", help="also each path with its minibatches recorded"
    )
    parser.add_argument(
        "--tape", action="store_true", help="with --recorded on a CPU: the tests' tape recorder"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recorder = None
    if args.recorded:
        recorder = tape_recorder() if args.tape else own_recorder(device)
        if recorder is None:
            parser.error(f"--recorded: {device} records nothing; on a CPU add --tape")
    config = PPOConfig()
    rollout_args = argparse.Namespace(
        data="digits", batch_size=128, episode_epochs=args.episode_epochs
    )
    print(
        f"PPO update on {device}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{config.update_epochs} epochs of {config.n_minibatches} minibatches, "
        f"{args.episode_epochs}-epoch episodes, median of {args.repeats}",
        flush=True,
    )
    print("| envs | steps | path | s / update | kernel ops / update |")
    print("|---:|---:|---|---:|---:|")
    for n_envs in args.n_envs:
        torch.manual_seed(0)
        collector = build(n_envs, rollout_args, device)
        batch, _ = collector.collect_batch(0)
        for path, made in PATHS.items():
            for record in (False, True) if recorder is not None else (False,):
                seconds, ops = measure(
                    made(batch),
                    collector.policy,
                    args.repeats,
                    device,
                    recorder if record else None,
                )
                name = f"{path}, recorded" if record else path
                print(
                    f"| {n_envs} | {batch.obs.shape[1]} | {name} | {seconds:.3f} | {ops} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
