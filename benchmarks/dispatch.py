"""What a host training step costs when its kernels cost nothing: dispatch, per engine.

On a GPU the predecessor's host is launch-bound (issue 35: 5% busy): a step's wall is
the host-side work of issuing its few dozen kernels (Python, the dispatcher, autograd,
the launches), not the kernels. That host-side cost can be measured on any machine by
making the kernels negligible: here each env trains on one 3x8x8 image per step (the
predecessor's network: channels 8, 16, 32, one conv a stage), on one thread, through
:func:`esper.tolaria.epoch.run_epoch` as a rollout trains hosts (validation included:
one batch of 8 images), for each engine of ``HostTraining.engine``. It prints
microseconds of wall per env step: per env for ``per_env``, the group's step shared out
for ``stacked`` (every env alike here, so all stack: the best case; a fit stacks a
share, ``benchmarks/stacking.py``).

On a CPU the kernels are not quite free (a stacked step's grouped convolutions grow with
the envs), so the figure is an upper bound on the dispatch cost; ``--device cuda``
measures the same on a GPU, where the kernels run beside the dispatch.

``--grown`` makes the hosts differ as a fit makes them: each slot of each env, drawn at
random (seeded), stays empty or holds a widening (the default blueprint) in TRAINING,
BLENDING or HOLDING, or has merged one (wider layers). The per-env path then runs each
env's own seeds; a stacked group runs every seed any member runs, on every member.

Usage: ``python benchmarks/dispatch.py [--n-envs 4 16 64] [--steps 40] [--device cpu]
[--grown]``
"""

from __future__ import annotations

import argparse
import time

import torch
from grown import QUICK, grown_apart
from torch import Tensor

from esper.kasmina import GrowingHost
from esper.kasmina.hosts.cnn import CNNHost
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import ENGINES, HostTraining

#: The predecessor's network on images small enough that its kernels cost next to nothing.
CHANNELS = (8, 16, 32)
IMAGE_SHAPE = (3, 8, 8)
CLASSES = 10
#: Images per env per step, and in the one validation batch.
IMAGES_PER_STEP = 1
VAL_IMAGES = 8


def batches(
    n_envs: int, steps: int, device: torch.device
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    generator = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, *IMAGE_SHAPE, generator=generator)
        y = torch.randint(0, CLASSES, (n,), generator=generator)
        return x.to(device), y.to(device)

    return [batch(n_envs * IMAGES_PER_STEP) for _ in range(steps)], [batch(VAL_IMAGES)]


def microseconds_per_env_step(
    n_envs: int, engine: str, steps: int, device: torch.device, grown: bool = False
) -> float:
    """Wall per env step of one timed epoch, after one warm-up epoch."""
    torch.manual_seed(0)
    envs = [
        GrowingHost(
            CNNHost(
                IMAGE_SHAPE,
                CLASSES,
                channels=CHANNELS,
                convs_per_stage=1,
                lifecycle=QUICK if grown else None,
            ).to(device)
        )
        for _ in range(n_envs)
    ]
    if grown:  # seeds are built on their host's device
        grown_apart(envs)
    train, val = batches(n_envs, steps, device)
    training = HostTraining(engine=engine, cpu_workers=1)
    run_epoch(envs, train, val, training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tick = time.perf_counter()
    run_epoch(envs, train, val, training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - tick) / (steps * n_envs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--steps", type=int, default=40, help="training steps per epoch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--grown", action="store_true", help="hosts grown apart by drawn widenings")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"dispatch cost on {device}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.steps} steps of {IMAGES_PER_STEP} {IMAGE_SHAPE} image per env"
        + (", hosts grown apart" if args.grown else ", fresh hosts"),
        flush=True,
    )
    rows = [
        (
            n,
            {
                engine: microseconds_per_env_step(n, engine, args.steps, device, args.grown)
                for engine in ENGINES
            },
        )
        for n in args.n_envs
    ]
    print()
    print(
        "| envs | " + " | ".join(f"{e} us / env step" for e in ENGINES) + " | per_env / stacked |"
    )
    print("|---:|" + "---:|" * (len(ENGINES) + 1))
    for n, cost in rows:
        figures = " | ".join(f"{cost[e]:.0f}" for e in ENGINES)
        print(f"| {n} | {figures} | {cost['per_env'] / cost['stacked']:.2f}x |")


if __name__ == "__main__":
    main()
