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

``--images N`` trains each env on N images a step instead of one: costs that grow with
the batch (the stacked engine's copies of mapped activations, which functorch makes
only for some layouts) show there, at kernels that cost more.

``--ops`` also counts, in one more epoch per engine, the operators a step issues that
would each launch a kernel on a GPU (``launch_rule``: every aten operator but views,
bare allocations, wrapped Python scalars and empty outputs; a multi-tensor ``_foreach``
operator counts once, as CUDA runs it), per env step: a count that does not depend on the machine, so it can be taken here
for a GPU, where a launch-bound step costs about that many launches.

Usage: ``python benchmarks/dispatch.py [--n-envs 4 16 64] [--steps 40] [--device cpu]
[--grown] [--images 1] [--ops]``
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any, NamedTuple

import launch_rule
import torch
from grown import QUICK, grown_apart
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from esper.kasmina import GrowingHost
from esper.kasmina.hosts.cnn import CNNHost
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import ENGINES, HostTraining

#: The predecessor's network on images small enough that its kernels cost next to nothing.
CHANNELS = (8, 16, 32)
IMAGE_SHAPE = (3, 8, 8)
CLASSES = 10
#: Images per env per step (``--images``' default), and in the one validation batch.
IMAGES_PER_STEP = 1
VAL_IMAGES = 8


def batches(
    n_envs: int, steps: int, device: torch.device, images: int = IMAGES_PER_STEP
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    generator = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, *IMAGE_SHAPE, generator=generator)
        y = torch.randint(0, CLASSES, (n,), generator=generator)
        return x.to(device), y.to(device)

    return [batch(n_envs * images) for _ in range(steps)], [batch(VAL_IMAGES)]


class KernelOps(TorchDispatchMode):
    """Counts the aten operators issued within it that would launch a kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if launch_rule.launches(func, out):
            self.counts[func.overloadpacket.__name__] += 1
        return out


class Case(NamedTuple):
    """One measurement's work: ``n_envs`` envs on ``engine`` for ``steps`` steps of
    ``images`` images each, fresh or ``grown`` apart."""

    n_envs: int
    engine: str
    steps: int
    device: torch.device
    grown: bool = False
    images: int = IMAGES_PER_STEP

    @property
    def env_steps(self) -> int:
        return self.steps * self.n_envs


def microseconds_per_env_step(case: Case) -> float:
    """Wall per env step of one timed epoch, after one warm-up epoch."""
    envs, train, val, training = setup(case)
    run_epoch(envs, train, val, training)
    if case.device.type == "cuda":
        torch.cuda.synchronize(case.device)
    tick = time.perf_counter()
    run_epoch(envs, train, val, training)
    if case.device.type == "cuda":
        torch.cuda.synchronize(case.device)
    return (time.perf_counter() - tick) / case.env_steps * 1e6


def kernel_ops_per_env_step(case: Case) -> float:
    """:class:`KernelOps` of one epoch (after a warm-up epoch) per env step."""
    envs, train, val, training = setup(case)
    run_epoch(envs, train, val, training)
    counter = KernelOps()
    with counter:
        run_epoch(envs, train, val, training)
    return sum(counter.counts.values()) / case.env_steps


def setup(
    case: Case,
) -> tuple[list[GrowingHost], list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]], Any]:
    """The same envs and batches for every measurement of one case."""
    torch.manual_seed(0)
    envs = [
        GrowingHost(
            CNNHost(
                IMAGE_SHAPE,
                CLASSES,
                channels=CHANNELS,
                convs_per_stage=1,
                lifecycle=QUICK if case.grown else None,
            ).to(case.device)
        )
        for _ in range(case.n_envs)
    ]
    if case.grown:  # seeds are built on their host's device
        grown_apart(envs)
    train, val = batches(case.n_envs, case.steps, case.device, case.images)
    return envs, train, val, HostTraining(engine=case.engine, cpu_workers=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--steps", type=int, default=40, help="training steps per epoch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--grown", action="store_true", help="hosts grown apart by drawn widenings")
    parser.add_argument(
        "--images", type=int, default=IMAGES_PER_STEP, help="images per env per training step"
    )
    parser.add_argument(
        "--ops", action="store_true", help="also count kernel-launching operators per env step"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"dispatch cost on {device}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.steps} steps of {args.images} {IMAGE_SHAPE} image(s) per env"
        + (", hosts grown apart" if args.grown else ", fresh hosts"),
        flush=True,
    )
    rows = [
        (
            n,
            {
                engine: microseconds_per_env_step(
                    Case(n, engine, args.steps, device, args.grown, args.images)
                )
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
    if not args.ops:
        return
    print()
    print("| envs | " + " | ".join(f"{e} kernel ops / env step" for e in ENGINES) + " |")
    print("|---:|" + "---:|" * len(ENGINES))
    for n in args.n_envs:
        ops = [
            kernel_ops_per_env_step(Case(n, e, args.steps, device, args.grown, args.images))
            for e in ENGINES
        ]
        print(f"| {n} | " + " | ".join(f"{count:.1f}" for count in ops) + " |", flush=True)


if __name__ == "__main__":
    main()
