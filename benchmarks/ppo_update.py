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
``KernelOps``: every aten operator but views, bare allocations and wrapped scalars),
the launches a launch-bound GPU pays for, whatever machine counts them.

Usage: ``python benchmarks/ppo_update.py [--n-envs 4 16] [--episode-epochs 25]
[--repeats 5] [--threads 1] [--device cpu]``
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from dispatch import KernelOps
from rollout import build, synchronize

from esper.simic.ppo import PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_batch import PPOBatch


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
    batch: PPOBatch, policy: torch.nn.Module, repeats: int, device: torch.device
) -> tuple[float, int]:
    """Median seconds of ``repeats`` updates and the kernel ops of one, each update from a
    copy of ``policy`` with a fresh optimizer, on ``batch``."""
    config = PPOConfig()

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--episode-epochs", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
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
            seconds, ops = measure(made(batch), collector.policy, args.repeats, device)
            print(
                f"| {n_envs} | {batch.obs.shape[1]} | {path} | {seconds:.3f} | {ops} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
