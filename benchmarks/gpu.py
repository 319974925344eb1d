"""Host training on one device: host steps/s and how busy the device is, by env count.

For each host (``predecessor``: esper-lite's ``cifar_baseline``, channels 8, 16, 32, one
conv a stage, 16 images per env step; ``gpu``: channels 32, 64, 128, two convs a stage, 64
images per env step) and each ``--n-envs``, it builds that many fresh
:class:`~esper.kasmina.GrowingHost` s on ``--device`` and trains them with
:func:`esper.tolaria.epoch.run_epoch` on random 3x32x32 images in 10 classes, as a rollout
trains them (every env on its share of each batch, then the fused validation with
counterfactual replicas). One warm-up epoch, then ``--epochs`` timed epochs:

* ``host steps/s``: env training steps (envs x batches) per second of wall, the device
  synchronised before and after;
* ``ms / host step``: its inverse;
* ``device busy``: on CUDA, the share of one more epoch's wall during which a kernel ran
  (the union of kernel intervals from ``torch.profiler``, so overlapping streams count
  once); ``n/a`` on a CPU;
* ``device ops / host step``: on CUDA, how many kernels, copies and fills the device ran
  in that epoch (``torch.profiler``'s device events) per host step: what
  ``benchmarks/dispatch.py --ops`` counts from the operators issued, seen from the device.

Each row is run by each of ``--engines`` (``HostTraining.engine``): ``per_env`` trains
each env's host on its own (a CUDA stream each), ``stacked`` trains envs of one
architecture as one mapped network (``esper.tolaria.stacked``), and, on CUDA only,
``stacked_graphs`` is ``stacked`` with each group's step recorded as a CUDA graph and
replayed (``HostTraining.cuda_graphs``, ``esper.tolaria.step_graph``): a default engine
there. Its device busy share and ops may miss the replayed kernels (the profiler sees a
graph's kernels only where CUPTI traces graph replays); its host steps/s are the figure. The hosts are fresh and
alike, so every env trains stacked with no seed to run: the best case for ``stacked``.
``--grown`` grows them apart as a fit does (``benchmarks/grown.py``: widenings at drawn
stages, some merged), so a stacked group runs every seed any member runs, on every
member, and the per-env path each env's own.

It prints one table for benchmarks/README. On one H100 the defaults take about two
minutes; ``--n-envs 2 --epochs 1 --train-images 64`` runs it in seconds on a CPU.

Usage: ``python benchmarks/gpu.py [--device cuda] [--n-envs 4 16 64] [--epochs 2]
[--hosts predecessor gpu] [--engines per_env stacked stacked_graphs] [--grown]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from grown import QUICK, grown_apart
from torch import Tensor

from esper.kasmina import GrowingHost
from esper.kasmina.hosts.cnn import CNNHost
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import ENGINES, HostTraining

#: The hosts of issue 35: esper-lite's and one sized for a GPU.
HOSTS: dict[str, dict[str, Any]] = {
    "predecessor": {"channels": (8, 16, 32), "convs_per_stage": 1, "images_per_env_step": 16},
    "gpu": {"channels": (32, 64, 128), "convs_per_stage": 2, "images_per_env_step": 64},
}
IMAGE_SHAPE = (3, 32, 32)
CLASSES = 10
#: Validation images, as issue 35's work (1 000 train / 200 validation).
VAL_IMAGES = 200
#: The stacked engine with its step recorded as a CUDA graph (CUDA only).
GRAPHS = "stacked_graphs"


def host_training(engine: str) -> HostTraining:
    """How ``engine`` (one of ``ENGINES``, or :data:`GRAPHS`) trains the hosts."""
    if engine == GRAPHS:
        return HostTraining(engine="stacked", cuda_graphs=True)
    return HostTraining(engine=engine)


def make_batches(
    n_envs: int, per_env: int, train_images: int, device: torch.device
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """Random train batches of ``per_env`` images for each env (``train_images`` per env
    in all) and the validation batches, already on ``device``."""
    generator = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, *IMAGE_SHAPE, generator=generator)
        y = torch.randint(0, CLASSES, (n,), generator=generator)
        return x.to(device), y.to(device)

    steps = max(1, train_images // per_env)
    train = [batch(per_env * n_envs) for _ in range(steps)]
    val = [batch(VAL_IMAGES)]
    return train, val


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_activity(run: Any, device: torch.device) -> tuple[float, int] | None:
    """The share of ``run()``'s wall during which a kernel ran on ``device``, and how many
    device events (kernels, copies, fills) it ran (CUDA only)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tick = time.perf_counter()
        run()
        synchronize(device)
        wall_us = (time.perf_counter() - tick) * 1e6
    intervals = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    busy = min(1.0, covered(intervals) / wall_us) if wall_us > 0 else 0.0
    return busy, len(intervals)


def covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: kernels that overlap (several
    streams) count once."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def measure(
    host: str, n_envs: int, engine: str, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    spec = HOSTS[host]
    torch.manual_seed(0)
    envs = [
        GrowingHost(
            CNNHost(
                input_shape=IMAGE_SHAPE,
                n_classes=CLASSES,
                channels=spec["channels"],
                convs_per_stage=spec["convs_per_stage"],
                lifecycle=QUICK if args.grown else None,
            ).to(device)
        )
        for _ in range(n_envs)
    ]
    if args.grown:  # seeds are built on their host's device
        grown_apart(envs)
    train, val = make_batches(n_envs, spec["images_per_env_step"], args.train_images, device)

    training = host_training(engine)

    def epoch() -> None:
        run_epoch(envs, train, val, training)

    epoch()  # warm-up: allocator, cuDNN autotuning, first launches
    synchronize(device)
    tick = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    synchronize(device)
    wall = time.perf_counter() - tick
    steps = n_envs * len(train) * args.epochs
    activity = device_activity(epoch, device)
    return {
        "host": host,
        "n_envs": n_envs,
        "engine": engine,
        "steps_per_s": steps / wall,
        "ms_per_step": wall / steps * 1e3,
        "busy": None if activity is None else activity[0],
        "device_ops": None if activity is None else activity[1] / (n_envs * len(train)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--n-envs", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hosts", nargs="+", default=list(HOSTS), choices=list(HOSTS))
    parser.add_argument("--train-images", type=int, default=1000, help="per env per epoch")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=[*ENGINES, GRAPHS],
        help=f"default: {' '.join(ENGINES)}, and {GRAPHS} on CUDA",
    )
    parser.add_argument("--grown", action="store_true", help="hosts grown apart, as in a fit")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.engines is None:
        args.engines = [*ENGINES, GRAPHS] if device.type == "cuda" else list(ENGINES)
    if GRAPHS in args.engines and device.type != "cuda":
        parser.error(f"{GRAPHS} records CUDA graphs: it needs --device cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"host training on {name} ({device}), torch {torch.__version__}, "
        f"{args.epochs} timed epoch(s) of {args.train_images} images per env, "
        f"threads {torch.get_num_threads()}, "
        + ("hosts grown apart" if args.grown else "fresh hosts"),
        flush=True,
    )
    rows = []
    for host in args.hosts:
        for n_envs in args.n_envs:
            for engine in args.engines:
                rows.append(measure(host, n_envs, engine, args, device))
                # Each row whole as it ends: a device call cut short keeps what it measured.
                print(f"  done: {table_row(rows[-1])}", flush=True)
    print()
    print(
        "| host | envs | engine | host steps/s | ms / host step | device busy "
        "| device ops / host step |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        print(table_row(row))


def table_row(row: dict[str, Any]) -> str:
    busy = "n/a" if row["busy"] is None else f"{row['busy']:.1%}"
    ops = "n/a" if row["device_ops"] is None else f"{row['device_ops']:.1f}"
    return (
        f"| {row['host']} | {row['n_envs']} | {row['engine']} | {row['steps_per_s']:.0f} | "
        f"{row['ms_per_step']:.2f} | {busy} | {ops} |"
    )


if __name__ == "__main__":
    main()
