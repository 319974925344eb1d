"""Where a fit's PPO update spends its seconds: ``esper fit`` timed by phase.

Why: on an H100 (issue 35, benchmarks/README.md) Esper took 3.2 s an update at 16 envs on
side_by_side's work, where ``benchmarks/gpu.py`` says its host training is a fraction of
that; the rest had no measurement. This runs that work (``side_by_side.sh``'s Esper
command: esper-lite's ``cifar_baseline`` host, random 3x32x32 images, 1 000 / 200, 16
images per env step, 8-epoch episodes; the arguments after ``--`` are added last, so they
win) in this process, after an untimed fit of one update (imports, CUDA's start, first
kernels):

1. a fit of ``--updates`` with the functions of :data:`PHASES` wrapped in timers (a clock
   read on entry and exit: about a microsecond a call): each phase's seconds per update,
   nested phases indented and counted in their parents;
2. with ``--counts``, one more such fit under :class:`PhaseTally`: each phase's operators
   that launch a kernel, scalar reads (``.item()`` and the like: on a GPU each waits for
   the device) and copies between host and device, per update. Why: Esper's CUDA update
   (3.2 s) was slower than esper-lite's (2.4 s) while issuing a fifth of its operators
   (16 530 an update against 82 672 at 16 envs: ``benchmarks/operator_counts.py``), so
   launches alone do not explain it; waits and transfers might, and where they happen
   is counted the same on any machine;
3. with ``--trace N``, one more under ``torch.profiler``: the N events with the most CPU
   time of their own (:func:`traced_events`). On CUDA the runtime's calls are events of
   their own (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cudaStreamSynchronize``,
   ``cudaMalloc``...), so this says how much of the host's time launching, waiting,
   copying and allocating take, which none of the counts above can;
4. ``--repeats`` pairs of fits of 1 and ``--updates`` updates, interleaved: seconds per
   update = (wall of the longer - wall of the shorter) / (updates - 1), their median;
5. with ``--top N``, one more under cProfile: the N functions with the most time of their
   own (cProfile's cost inflates Python-heavy code; its figures rank, they do not time).

Each part prints as it ends, the phases first, so a time limit that cuts the script
short (a device lease) keeps what ran.

On CUDA the host waits for the device at the step's one read (``read_packed``) and a few
others (the PPO update's early-stop read, checkpoints): time there is the GPU's work not
yet done, time elsewhere the CPU's (launches and Python). Phases are timed on the main
thread: on a CPU the per-env engine trains and validates in worker threads, which shows
as ``run_epoch`` waiting for them, and their operators go uncounted (a dispatch mode
sees its own thread). With images so small that compute is near nothing
(``-- --model.engine stacked --data.input_shape '[3,4,4]'``) a CPU measures the
host-side cost a GPU run pays (benchmarks/README.md).

Usage: ``python benchmarks/update_profile.py [--device cuda] [--n-envs 16] [--updates 3]
[--repeats 2] [--counts] [--trace 0] [--top 0] [-- MORE FIT ARGUMENTS]``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import importlib
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from launch_rule import launches
from torch.utils._python_dispatch import TorchDispatchMode

from esper import cli

#: Phases of an update: label -> where the function is looked up when it is called
#: ("module:Class.method" or "module:function", the module that calls a function by a
#: name it imported). Indentation nests a phase in the one above it.
PHASES: dict[str, str] = {
    "update (one PPO update)": "esper.simic.module:PPOModule._train_one_update",
    "  rollout": "esper.mdp.rollout:RolloutCollector.collect",
    "    host epochs (run_epoch)": "esper.mdp.env:run_epoch",
    "      stacked steps": "esper.tolaria.stacked:StackedGroup.step",
    "      stacked validation": "esper.tolaria.epoch:validate_stacked",
    "      per-env validation": "esper.tolaria.epoch:validate_with_counterfactuals",
    "    observe": "esper.mdp.env:MorphogeneticVecEnv.observe",
    "    policy act": "esper.tamiyo.policy:PolicyNetwork.act",
    # With cuda_graphs the rollout acts through this; the acts it runs as they are (a
    # run's first, its warm-up, its recording) count in "policy act" too.
    "    recorded act (cuda_graphs)": "esper.mdp.recorded_act:RecordedAct.__call__",
    "    the step's read (waits for the device)": "esper.mdp.step_read:read_packed",
    "    governor": "esper.mdp.governor:Steering.steer",
    "    lifecycle (apply)": "esper.mdp.env:MorphogeneticVecEnv.apply",
    "    buffer add": "esper.simic.buffer:RolloutBuffer.add",
    "    pricing (close)": "esper.mdp.rollout:RolloutCollector._close",
    "  PPO update": "esper.simic.module:ppo_update",
    "checkpoint save": "esper.callbacks.checkpoint:EsperCheckpointIO.save_checkpoint",
}


def fit_arguments(n_envs: int, updates: int, device: str, root: str) -> list[str]:
    """``side_by_side.sh``'s Esper command for ``n_envs`` and ``updates``."""
    return [
        "fit", "--seed_everything", "0", "--data", "synthetic",
        "--data.input_shape", "[3,32,32]", "--data.n_classes", "10",
        "--data.n_train", "1000", "--data.n_val", "200",
        "--data.batch_size", str(16 * n_envs), "--data.val_batch_size", "200",
        "--model.host_kwargs", '{"channels":[8,16,32],"convs_per_stage":1}',
        "--model.n_envs", str(n_envs), "--model.episode_epochs", "8",
        "--model.ppo.paired_envs", "false", "--model.ppo.critic_baseline", "true",
        "--model.ppo.vf_coef", "0.5",
        "--trainer.accelerator", "gpu" if device == "cuda" else "cpu",
        "--trainer.max_epochs", str(updates), "--trainer.default_root_dir", root,
    ]  # fmt: skip


def run_fit(arguments: Sequence[str]) -> None:
    """``esper fit`` with ``arguments``, in this process, its printed lines kept back (shown
    if it fails); this script's own arguments are hidden from the CLI, which reads them."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            cli.main(list(arguments))
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            print(printed.getvalue())
            raise RuntimeError(f"esper fit failed (exit {exit_.code})") from None
    finally:
        sys.argv = argv


def _owner_and_name(where: str) -> tuple[Any, str]:
    module_name, path = where.split(":")
    owner: Any = importlib.import_module(module_name)
    *classes, name = path.split(".")
    for class_name in classes:
        owner = getattr(owner, class_name)
    return owner, name


@contextlib.contextmanager
def timed_phases(seconds: dict[str, float], running: list[str] | None = None) -> Iterator[None]:
    """Within the block, each phase's function adds its wall to ``seconds[label]``; while
    it runs its label is on ``running`` (innermost last), for :class:`PhaseTally`."""
    patched: list[tuple[Any, str, Any]] = []
    stack = [] if running is None else running

    def timer(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(label)
            tick = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - tick
                stack.pop()

        return timed

    try:
        for label, where in PHASES.items():
            owner, name = _owner_and_name(where)
            function = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            patched.append((owner, name, function))
            setattr(owner, name, timer(label, function))
        yield
    finally:
        for owner, name, function in reversed(patched):
            setattr(owner, name, function)


#: Where a tally outside every phase goes: Lightning's loop, callbacks, the fit's start.
OUTSIDE = "whole fit (start, Lightning, callbacks too)"
#: :class:`PhaseTally`'s columns.
TALLIES = ("ops", "reads", "waits", "to device", "to host")


class PhaseTally(TorchDispatchMode):
    """Per phase, the operators run in this thread while it is running (a phase counts
    its nested phases' too, as its seconds do), in :data:`TALLIES`:

    - ``ops``: operators that launch a kernel on a GPU (``launch_rule``: views, bare
      allocations, wrapped scalars and empty outputs launch none), reads and copies
      excluded;
    - ``reads``: ``_local_scalar_dense``, what ``.item()``, ``float()``, ``if tensor:``
      run (a CPU generator's seed draws among them); ``waits``: those of a device's
      tensor, each of which waits for every kernel queued before it;
    - ``to device``, ``to host``: copies between the host and a device (``.to``,
      ``.cpu()``, ``copy_``); one to the host waits for the device unless non-blocking.

    Every operator is also counted under :data:`OUTSIDE`, the fit's total.
    """

    def __init__(self, running: list[str]) -> None:
        super().__init__()
        self.running = running
        self.counts: dict[str, collections.Counter[str]] = {
            tally: collections.Counter() for tally in TALLIES
        }

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tallies: tuple[str, ...]
        if name == "_local_scalar_dense":
            tallies = ("reads", "waits") if args[0].device.type != "cpu" else ("reads",)
        elif name in ("_to_copy", "copy_") and (moved := _moved(name, args, out)):
            tallies = (moved,)
        elif launches(func, out):
            tallies = ("ops",)
        else:
            return out
        for tally in tallies:
            counter = self.counts[tally]
            counter[OUTSIDE] += 1
            for label in set(self.running):
                counter[label] += 1
        return out

    def row(self, label: str) -> list[int]:
        return [self.counts[tally][label] for tally in TALLIES]


def _moved(name: str, args: tuple, out: Any) -> str | None:
    """``"to device"`` or ``"to host"`` where a ``_to_copy`` (of ``args[0]`` into ``out``)
    or a ``copy_`` (of ``args[1]`` into ``args[0]``) moves data between the host and a
    device; None where it stays on one side."""
    source, target = (args[1], args[0]) if name == "copy_" else (args[0], out)
    kinds = source.device.type, target.device.type
    if kinds[0] == kinds[1] or "cpu" not in kinds:
        return None
    return "to host" if kinds[1] == "cpu" else "to device"


def traced_events(events: Any, top: int) -> list[tuple[float, int, str]]:
    """The ``top`` of ``torch.profiler``'s averaged events (``key_averages()``) by CPU time
    of their own, as (microseconds, calls, name)."""
    rows = [(event.self_cpu_time_total, event.count, event.key) for event in events]
    return sorted(rows, reverse=True)[:top]


def own_time(stats: pstats.Stats, top: int) -> list[tuple[float, str]]:
    """The ``top`` functions by time of their own (tottime), as (seconds, where)."""
    rows = [
        (row[2], f"{path.split('site-packages/')[-1].split('src/')[-1]}:{line}({name})")
        for (path, line, name), row in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return sorted(rows, reverse=True)[:top]


def esper_time(stats: pstats.Stats, top: int) -> list[tuple[float, str]]:
    """The ``top`` of Esper's own functions by the time spent inside them, callees
    included (cumtime), as (seconds, where): which of a phase's steps its seconds go to
    (a governor's snapshot: the tensor copies or the pickling; a group's set-up)."""
    rows = [
        (row[3], f"{path.split('site-packages/')[-1].split('src/')[-1]}:{line}({name})")
        for (path, line, name), row in stats.stats.items()  # type: ignore[attr-defined]
        if "/esper/" in path.replace("\\", "/") and "/esper/cli/" not in path
    ]
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ours, extra = (sys.argv[1:], [])
    if "--" in ours:
        cut = ours.index("--")
        ours, extra = ours[:cut], ours[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--n-envs", type=int, default=16)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed pairs of fits (0: none)")
    parser.add_argument(
        "--counts", action="store_true", help="operators, reads and copies by phase"
    )
    parser.add_argument(
        "--trace", type=int, default=0, help="torch.profiler's top events (CUDA's calls too)"
    )
    parser.add_argument("--top", type=int, default=0, help="cProfile's top functions")
    args = parser.parse_args(ours)
    if args.updates < 2:
        parser.error("--updates must be >= 2 (an update's time is a difference of fits)")
    if args.repeats < 0:
        parser.error("--repeats must be >= 0 (0 skips the unprofiled timing)")

    def fit(updates: int, root: str) -> float:
        tick = time.perf_counter()
        run_fit([*fit_arguments(args.n_envs, updates, args.device, root), *extra])
        return time.perf_counter() - tick

    with tempfile.TemporaryDirectory() as root:
        fit(1, f"{root}/warm")
        seconds = dict.fromkeys(PHASES, 0.0)
        with timed_phases(seconds):
            fit(args.updates, f"{root}/timed")
        print(f"\n{args.n_envs} envs on {args.device}, phases of a fit of {args.updates}:")
        print(f"{'phase':<48} {'s / update':>10}")
        for label, total in seconds.items():
            print(f"{label:<48} {total / args.updates:10.3f}")
        if args.counts:
            running: list[str] = []
            with timed_phases(dict.fromkeys(PHASES, 0.0), running), PhaseTally(running) as tally:
                fit(args.updates, f"{root}/counted")
            print(f"\ncounted per update (a fit of {args.updates}, this thread's operators):")
            print(f"{'phase':<48}" + "".join(f"{name:>10}" for name in TALLIES))
            for label in [*PHASES, OUTSIDE]:
                counts = "".join(f"{n / args.updates:10.0f}" for n in tally.row(label))
                print(f"{label:<48}{counts}")
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as traced:
                fit(args.updates, f"{root}/traced")
            print("\nmost CPU time of their own under torch.profiler, per update:")
            print(f"{'ms':>9} {'calls':>8}  event")
            for micros, calls, name in traced_events(traced.key_averages(), args.trace):
                print(f"{micros / 1e3 / args.updates:9.1f} {calls / args.updates:8.0f}  {name}")
        per_update = [
            (fit(args.updates, f"{root}/long{r}") - fit(1, f"{root}/short{r}")) / (args.updates - 1)
            for r in range(args.repeats)
        ]
        if per_update:  # --repeats 0: the other parts only
            print(
                f"\n{args.n_envs} envs on {args.device}: {statistics.median(per_update):.3f} s an "
                f"update unprofiled (median of {args.repeats}: "
                + ", ".join(f"{s:.3f}" for s in per_update)
                + ")"
            )
        if args.top:
            profile = cProfile.Profile()
            profile.enable()
            fit(args.updates, f"{root}/profiled")
            profile.disable()
            stats = pstats.Stats(profile)
            print("\nmost time of their own under cProfile (s / update):")
            for own, where in own_time(stats, args.top):
                print(f"{own / args.updates:8.3f}  {where}")
            print("\nEsper's functions by time inside them, callees included (s / update):")
            for inside, where in esper_time(stats, args.top):
                print(f"{inside / args.updates:8.3f}  {where}")


if __name__ == "__main__":
    main()
