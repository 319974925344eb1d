"""How to launch many small hosts' training steps: a lead measurement for issue 35's engine.

Issue 35 asks Esper's GPU engine to be chosen by measurement among three ways of
training every env's host in few launches: a CUDA graph of a host's train step, stacking
envs whose hosts share an architecture, and launching from several threads. Esper has
built one of them (``HostTraining.engine="stacked"``, measured by ``gpu.py`` and
``dispatch.py``); this script measures all of them, and their combination, on plain
PyTorch, so that one GPU session can say which is worth building before it is built.
Its figures are of these plain loops, not of Esper: what each way could reach.

The work: ``N`` copies of a host's network (``gpu.py``'s hosts: the predecessor's,
channels 8, 16, 32, one conv a stage, 16 images per step; or the GPU-sized one), each
with its own weights, trained by SGD with momentum on its own random 3x32x32 images in
10 classes: ``--warmup`` steps, then ``--steps`` timed ones, the same batches for every
way. The ways:

* ``one_thread``: each net's step launched one after another from one thread, each net
  on its own CUDA stream (what Esper's ``per_env`` engine does on a GPU);
* ``threads``: the same nets shared out over ``--threads`` Python threads, each net on
  its own stream (torch releases the GIL while it dispatches an op);
* ``graphs``: each net's whole step (forward, loss, backward, SGD) captured once as a
  CUDA graph after the warm-up, then replayed on its stream with the batch copied into
  the graph's input (CUDA only);
* ``stacked``: every net's parameters, buffers and momentum stacked along a leading
  dimension, the forward mapped over it with ``torch.func.vmap``, one backward, one SGD
  step (what Esper's ``stacked`` engine does);
* ``stacked_graph``: the stacked step captured as one CUDA graph (CUDA only).

For each, it prints microseconds of wall per host step (one net, one batch), the
device's busy share on CUDA (``gpu.py``'s: the union of kernel intervals over one more
pass of the timed steps; a graph's kernels reach the profiler only where CUPTI traces
graph replays, so a busy share near 0% on a graph way means an untraced replay, and the
microseconds are the figure to compare), and how far the nets' weights end from ``one_thread``'s
after the warm-up and timed steps (each net's largest difference, the median over nets):
the check that every way computed the same training (graphs replay the same kernels; a
stacked convolution sums in another order). Rounding can send a single net apart: on
this project's 2-core CPU, ``threads``, which differs from ``one_thread`` only in how
many cores a convolution uses, left two of 16 predecessor nets 4e-4 and 6e-5 apart after
13 steps and the other 14 within 1e-7 (presumably a near-tie in a max-pool or a ReLU
settled the other way), so the median, not the largest, says whether a way trained the
wrong thing, which would move every net. On the GPU-sized host (six batch-normed convs)
rounding grows about threefold a step on every net: ``threads`` there was 2e-8 from
``one_thread`` after 2 steps, 6e-6 after 4, 9e-5 after 7 and 7e-4 after 13, so its
rows say only that no way is far beyond the others. A way that fails prints its error in its row;
the others still run.

Usage: ``python benchmarks/launch_strategies.py [--device cuda] [--n-envs 16 64]
[--hosts predecessor gpu] [--steps 10] [--warmup 3] [--threads 4]``. Not yet run on a GPU:
the defaults are sized for the two minutes ``device_session.sh`` gives them (rows print as
they are measured, so a timeout keeps the ones done); ``--device cpu --n-envs 2 --steps
2`` runs in seconds (the graph ways say ``n/a``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from gpu import CLASSES, HOSTS, IMAGE_SHAPE, device_activity, synchronize
from torch import Tensor, nn
from torch.func import functional_call, vmap

WAYS = ("one_thread", "threads", "graphs", "stacked", "stacked_graph")
#: The ways that need CUDA graphs.
GRAPH_WAYS = ("graphs", "stacked_graph")
LEARNING_RATE = 0.01
MOMENTUM = 0.9

Batch = tuple[Tensor, Tensor]


def make_net(channels: tuple[int, ...], convs_per_stage: int) -> nn.Sequential:
    """The host's trunk in plain PyTorch: conv, batch norm, ReLU per conv, a max-pool per
    stage, global average pooling and a linear head (the layers of Esper's ``CNNHost``)."""
    layers: list[nn.Module] = []
    width = IMAGE_SHAPE[0]
    for out in channels:
        for _ in range(convs_per_stage):
            layers += [nn.Conv2d(width, out, 3, padding=1, bias=False), nn.BatchNorm2d(out)]
            layers.append(nn.ReLU())
            width = out
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, CLASSES)]
    return nn.Sequential(*layers)


def sgd(params: list[Tensor], grads: list[Tensor], buffers: list[Tensor]) -> None:
    """SGD with momentum as three fused list ops (buffers start at zero, so the first step
    moves by the gradient, as torch's SGD does); nothing on the host, so a graph holds it."""
    with torch.no_grad():
        torch._foreach_mul_(buffers, MOMENTUM)
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(params, buffers, alpha=-LEARNING_RATE)


class Net:
    """One host's network, its momentum buffers and its CUDA stream (None on a CPU)."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.params = list(module.parameters())
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def step(self, x: Tensor, y: Tensor) -> None:
        for p in self.params:
            p.grad = None
        F.cross_entropy(self.module(x), y).backward()
        sgd(self.params, [p.grad for p in self.params], self.buffers)  # type: ignore[misc]

    def on_stream(self) -> Any:
        return nullcontext() if self.stream is None else torch.cuda.stream(self.stream)


def fresh_nets(host: str, n: int, device: torch.device) -> list[Net]:
    """``n`` nets with the same initial weights for every way (seeded)."""
    spec = HOSTS[host]
    torch.manual_seed(0)
    return [
        Net(make_net(spec["channels"], spec["convs_per_stage"]).to(device).train(), device)
        for _ in range(n)
    ]


def make_batches(host: str, n: int, steps: int, device: torch.device) -> list[Batch]:
    """One batch per step of ``n`` shares of the host's images per step, on ``device``."""
    per = HOSTS[host]["images_per_env_step"]
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(n * per, *IMAGE_SHAPE, generator=generator)
        y = torch.randint(0, CLASSES, (n * per,), generator=generator)
        out.append((x.to(device), y.to(device)))
    return out


def share(batch: Batch, i: int, n: int) -> Batch:
    x, y = batch
    per = x.shape[0] // n
    return x[i * per : (i + 1) * per], y[i * per : (i + 1) * per]


def fork_streams(nets: list[Net], device: torch.device) -> None:
    """Each net's stream waits for the calling thread's (where the batches were made):
    once a pass, not once a step."""
    if device.type == "cuda":
        for net in nets:
            assert net.stream is not None
            net.stream.wait_stream(torch.cuda.current_stream(device))


def join_streams(nets: list[Net], device: torch.device) -> None:
    if device.type == "cuda":
        for net in nets:
            assert net.stream is not None
            torch.cuda.current_stream(device).wait_stream(net.stream)


# --------------------------------------------------------------------- the ways
# Each builder takes the nets, the warm-up batches and the device, runs the warm-up and
# returns ``run(batches)``, which trains every net on every batch and leaves the device
# work queued (the caller synchronises).
Runner = Callable[[list[Batch]], None]


def one_thread(nets: list[Net], warmup: list[Batch], device: torch.device) -> Runner:
    def run(batches: list[Batch]) -> None:
        fork_streams(nets, device)
        for batch in batches:
            for i, net in enumerate(nets):
                x, y = share(batch, i, len(nets))
                with net.on_stream():
                    net.step(x, y)
        join_streams(nets, device)

    run(warmup)
    return run


def several_threads(
    nets: list[Net], warmup: list[Batch], device: torch.device, threads: int
) -> Runner:
    threads = max(1, min(threads, len(nets)))
    per_thread = max(1, torch.get_num_threads() // threads)

    def work(mine: list[int], batches: list[Batch], errors: list[BaseException]) -> None:
        torch.set_num_threads(per_thread)  # a CPU's cores shared out, as Esper's workers
        try:
            for batch in batches:
                for i in mine:
                    x, y = share(batch, i, len(nets))
                    with nets[i].on_stream():
                        nets[i].step(x, y)
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)

    def run(batches: list[Batch]) -> None:
        fork_streams(nets, device)
        errors: list[BaseException] = []
        pool = [
            threading.Thread(
                target=work, args=(list(range(t, len(nets), threads)), batches, errors)
            )
            for t in range(threads)
        ]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        if errors:
            raise errors[0]
        join_streams(nets, device)

    run(warmup)
    return run


def graphs(nets: list[Net], warmup: list[Batch], device: torch.device) -> Runner:
    """Warm up eagerly on the nets' streams, then capture each net's step once."""
    one_thread(nets, warmup, device)
    n = len(nets)
    static = [tuple(t.clone() for t in share(warmup[-1], i, n)) for i in range(n)]
    captured = []
    synchronize(device)
    for net, (x, y) in zip(nets, static, strict=True):
        for p in net.params:
            p.grad = None  # the graph's backward makes the gradients in its own pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=net.stream):
            net.step(x, y)
        captured.append(graph)
    synchronize(device)

    def run(batches: list[Batch]) -> None:
        fork_streams(nets, device)
        for batch in batches:
            for i, (net, graph) in enumerate(zip(nets, captured, strict=True)):
                x, y = share(batch, i, n)
                with net.on_stream():
                    static[i][0].copy_(x, non_blocking=True)
                    static[i][1].copy_(y, non_blocking=True)
                    graph.replay()
        join_streams(nets, device)

    return run


class Stacked:
    """Every net as one: parameters, buffers and momentum stacked, the forward vmapped."""

    def __init__(self, nets: list[Net]) -> None:
        self.nets = nets
        self.template = nets[0].module
        params = [dict(n.module.named_parameters()) for n in nets]
        buffers = [dict(n.module.named_buffers()) for n in nets]
        self.params = {
            name: torch.stack([own[name] for own in params]).detach().requires_grad_()
            for name in params[0]
        }
        self.buffers = {name: torch.stack([own[name] for own in buffers]) for name in buffers[0]}
        self.momentum = [torch.zeros_like(p) for p in self.params.values()]

        def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
            return functional_call(self.template, (params, buffers), (x,))

        self.forward = vmap(forward, in_dims=(0, 0, 0))

    def step(self, x: Tensor, y: Tensor) -> None:
        """``x`` ``[N, b, C, H, W]``, ``y`` ``[N, b]``: each net's mean loss, summed, so each
        net's weights get the gradient of its own loss."""
        params = list(self.params.values())
        for p in params:
            p.grad = None
        logits = self.forward(self.params, self.buffers, x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss.view(y.shape).mean(dim=1).sum().backward()
        sgd(params, [p.grad for p in params], self.momentum)  # type: ignore[misc]

    def write_back(self) -> None:
        """Put the stacked weights and statistics into the nets (for the comparison)."""
        with torch.no_grad():
            for i, net in enumerate(self.nets):
                for name, p in net.module.named_parameters():
                    p.copy_(self.params[name][i])
                for name, b in net.module.named_buffers():
                    b.copy_(self.buffers[name][i])


def stacked_views(batch: Batch, n: int) -> Batch:
    x, y = batch
    return x.view(n, x.shape[0] // n, *x.shape[1:]), y.view(n, -1)


def stacked(nets: list[Net], warmup: list[Batch], device: torch.device) -> Runner:
    group = Stacked(nets)

    def run(batches: list[Batch]) -> None:
        for batch in batches:
            group.step(*stacked_views(batch, len(nets)))
        group.write_back()

    run(warmup)
    return run


def stacked_graph(nets: list[Net], warmup: list[Batch], device: torch.device) -> Runner:
    group = Stacked(nets)
    n = len(nets)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for batch in warmup:
            group.step(*stacked_views(batch, n))
    torch.cuda.current_stream(device).wait_stream(side)
    static = tuple(t.clone() for t in stacked_views(warmup[-1], n))
    for p in group.params.values():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        group.step(*static)

    def run(batches: list[Batch]) -> None:
        for batch in batches:
            x, y = stacked_views(batch, n)
            static[0].copy_(x, non_blocking=True)
            static[1].copy_(y, non_blocking=True)
            graph.replay()
        group.write_back()

    return run


def build(
    way: str, nets: list[Net], warmup: list[Batch], device: torch.device, threads: int
) -> Runner:
    if way == "threads":
        return several_threads(nets, warmup, device, threads)
    builders = {
        "one_thread": one_thread,
        "graphs": graphs,
        "stacked": stacked,
        "stacked_graph": stacked_graph,
    }
    return builders[way](nets, warmup, device)


def weights(nets: list[Net]) -> list[list[Tensor]]:
    """Each net's parameters (batch-norm statistics follow from them and run to the
    hundreds, so their differences say nothing more)."""
    return [[p.detach().clone() for p in net.module.parameters()] for net in nets]


def net_difference(a: list[Tensor], b: list[Tensor]) -> float:
    """The largest difference of any of one net's weights."""
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def typical_difference(a: list[list[Tensor]], b: list[list[Tensor]]) -> float:
    """The median over nets of each net's largest weight difference: rounding can send
    one net a step's worth apart, a way that trained the wrong thing moves them all."""
    return statistics.median(net_difference(x, y) for x, y in zip(a, b, strict=True))


def measure(
    way: str,
    host: str,
    n: int,
    args: argparse.Namespace,
    device: torch.device,
    reference: list[list[Tensor]] | None,
) -> tuple[dict[str, Any], list[list[Tensor]] | None]:
    """One row: ``way`` on ``n`` nets of ``host``; and the nets' weights after the timed
    steps (``one_thread``'s are the reference the other ways are compared with)."""
    row: dict[str, Any] = {"host": host, "n": n, "way": way}
    if way in GRAPH_WAYS and device.type != "cuda":
        return row | {"error": "n/a (CUDA graphs need a GPU)"}, None
    batches = make_batches(host, n, args.warmup + args.steps, device)
    warmup, timed = batches[: args.warmup], batches[args.warmup :]
    try:
        nets = fresh_nets(host, n, device)
        run = build(way, nets, warmup, device, args.threads)
        synchronize(device)
        tick = time.perf_counter()
        run(timed)
        synchronize(device)
        wall = time.perf_counter() - tick
        after = weights(nets)
        activity = device_activity(lambda: run(timed), device)
        busy = None if activity is None else activity[0]
    except Exception as exc:  # a way that cannot run says why in its row
        return row | {"error": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}, None
    row["us_per_step"] = wall / (args.steps * n) * 1e6
    row["busy"] = busy
    row["difference"] = None if reference is None else typical_difference(after, reference)
    return row, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-envs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--hosts", nargs="+", choices=sorted(HOSTS), default=list(HOSTS))
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps of every net")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--threads", type=int, default=4, help="Python threads of 'threads'")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error(
            "--steps and --warmup must be at least 1 (a graph is captured after a warm-up)"
        )
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"launch strategies on {device} ({name}), torch {torch.__version__}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.threads} threads",
        flush=True,
    )
    print("| host | envs | way | us / host step | device busy | weight difference (median net) |")
    print("|---|---:|---|---:|---:|---:|")
    ways = ["one_thread"] + [w for w in args.ways if w != "one_thread"]
    for host in args.hosts:
        for n in args.n_envs:
            reference: list[list[Tensor]] | None = None
            for way in ways:
                row, after = measure(way, host, n, args, device, reference)
                if way == "one_thread":
                    reference = after
                print(format_row(row), flush=True)


def format_row(row: dict[str, Any]) -> str:
    head = f"| {row['host']} | {row['n']} | {row['way']} |"
    if "error" in row:
        return f"{head} {row['error']} | | |"
    busy = "n/a" if row["busy"] is None else f"{row['busy']:.1%}"
    diff = "reference" if row["difference"] is None else f"{row['difference']:.1e}"
    return f"{head} {row['us_per_step']:.0f} | {busy} | {diff} |"


if __name__ == "__main__":
    main()
