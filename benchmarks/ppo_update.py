"""What one PPO update costs: seconds and kernel-launching operators, per replay path.

The update replays every minibatch's recurrent states (``PolicyNetwork.evaluate``).
A rollout is one episode an env, so unless a governor restore broke a chain
(``PPOBatch.unbroken``), the LSTM replays whole sequences in one fused call; otherwise
it steps through them in Python, a cell, a reset and two stacks a step. This collects
one real rollout (``benchmarks/rollout.py``'s collector: digits, the default CNN host,
a fresh policy, ``--episode-epochs`` host epochs) and times ``ppo_update`` with the
default ``PPOConfig`` on it both ways, on the same batch and from the same policy:

- *fused*: the batch as the buffer made it (``unbroken`` when no restore broke it);
- *step loop*: the same batch with ``unbroken=False``.

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

import torch
from dispatch import KernelOps
from rollout import build, synchronize

from esper.simic.ppo import PPOConfig, make_optimizer, ppo_update
from esper.simic.ppo_batch import PPOBatch

#: The two replay paths, by whether the batch claims an unbroken chain of states.
PATHS = {"fused": True, "step loop": False}


def measure(
    batch: PPOBatch, policy: torch.nn.Module, unbroken: bool, repeats: int, device: torch.device
) -> tuple[float, int]:
    """Median seconds of ``repeats`` updates and the kernel ops of one, each update from a
    copy of ``policy`` with a fresh optimizer, on ``batch`` with ``unbroken`` set."""
    config = PPOConfig()
    batch = dataclasses.replace(batch, unbroken=unbroken)

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
        for path, unbroken in PATHS.items():
            if unbroken and not batch.unbroken:
                print(f"| {n_envs} | {batch.obs.shape[1]} | {path} | n/a (a restore) | |")
                continue
            seconds, ops = measure(batch, collector.policy, unbroken, args.repeats, device)
            print(
                f"| {n_envs} | {batch.obs.shape[1]} | {path} | {seconds:.3f} | {ops} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
