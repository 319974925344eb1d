"""Rollout throughput: env steps/s, host reads per step, time spent outside host training.

For each ``n_envs`` the script builds the real env (CNN host on the embedded digits data
unless told otherwise), a fresh policy and a collector, runs one warm-up rollout, then:

1. times ``--repeats`` rollouts as they run in training (no extra syncs): env steps/s,
   where an env step is one decision of one env (``n_envs * (episode_epochs - 1)`` per
   rollout) and host epochs/s counts ``run_epoch`` calls;
2. runs one rollout under :class:`HostReadCounter` and reports reads per host epoch
   (DataLoader/sampler bookkeeping on CPU index tensors excluded, as in the tests);
3. runs one rollout with the device synchronised before and after every host epoch, so
   host-training time is attributed correctly on CUDA (where ``run_epoch`` returns before
   its kernels finish), and reports the fraction of rollout time outside host training.

With ``--overhead`` it instead times, for esper-lite's host and the default host at 4 and
8 envs, whole PPO updates as ``Trainer.fit`` runs them against the pure host compute of
the same work (``benchmarks/rollout_overhead.py`` says exactly what each side holds);
``--rounds N`` alternates the thread counts N times per case and prints medians;
``--wall-only`` times the updates alone, for the thread counts' ratio.

With ``--telemetry`` it then times rollouts of the smallest ``n_envs`` with the
:class:`TelemetryCallback` hooks called as in training, for each profile, and prints each
profile's rollout time as a ratio to the same rollouts with telemetry off.

Usage: ``python benchmarks/rollout.py [--device cuda] [--episode-epochs 5] [--repeats 2]
[--telemetry]``
or ``python benchmarks/rollout.py --overhead --episode-epochs 8 [--rounds 3] [--wall-only]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from esper.cli.options import quiet_third_party
from esper.host_reads import HostReadCounter
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig
from esper.simic.buffer import RolloutBuffer
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.ppo import PPOConfig
from esper.simic.ppo_collector import PPOCollector
from esper.tamiyo.policy import PolicyConfig, PolicyNetwork
from esper.tolaria.data import DATAMODULES

N_ENVS = (2, 4, 8)
#: Rollouts run before timing telemetry, so allocator and kernel warm-up is not billed to it.
TELEMETRY_WARMUP_ROLLOUTS = 2
#: The training defaults' discounting, so the GAE timed is the one a run computes.
GAMMA, GAE_LAMBDA = PPOConfig.gamma, PPOConfig.gae_lambda


def build(n_envs: int, args: argparse.Namespace, device: torch.device) -> PPOCollector:
    data = DATAMODULES.get(args.data)(batch_size=args.batch_size)
    env = MorphogeneticVecEnv(
        EnvConfig(n_envs=n_envs, episode_epochs=args.episode_epochs), data, device
    )
    policy = PolicyNetwork(env.layout.dim, env.schema, PolicyConfig()).to(device)
    config = policy.config
    buffer = RolloutBuffer(
        n_envs,
        env.decisions_per_episode,
        env.layout.dim,
        env.schema,
        (config.lstm_layers, config.hidden_size),
        device,
    )
    normalizer = RunningObsNormalizer(env.layout.dim).to(device)
    return PPOCollector(env, policy, normalizer, buffer, GAMMA, GAE_LAMBDA)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def with_synced_epochs(collector: PPOCollector, device: torch.device) -> Callable[[], None]:
    """Make every host epoch end only when its device work has; returns the undo."""
    env = collector.env
    original = env.train_epoch

    def synced() -> object:
        synchronize(device)
        result = original()
        synchronize(device)
        return result

    env.train_epoch = synced  # type: ignore[method-assign]

    def undo() -> None:
        env.train_epoch = original  # type: ignore[method-assign]

    return undo


def measure(n_envs: int, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    collector = build(n_envs, args, device)
    collector.collect_batch(0)  # warm-up: allocator, kernels, data loading
    host_epochs = collector.env.config.episode_epochs
    decisions = n_envs * collector.env.decisions_per_episode

    seconds = []
    for r in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        collector.collect_batch(r + 1)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    wall = statistics.median(seconds)

    with HostReadCounter() as counter:
        collector.collect_batch(args.repeats + 1)

    undo = with_synced_epochs(collector, device)
    try:
        _, summary = collector.collect_batch(args.repeats + 2)
    finally:
        undo()
    return {
        "env_steps_per_s": decisions / wall,
        "host_epochs_per_s": host_epochs / wall,
        "reads_per_host_epoch": counter.count / host_epochs,
        "outside_training": 1.0 - summary.seconds_training_hosts / summary.seconds,
        "rollout_s": wall,
    }


def telemetry_costs(args: argparse.Namespace, device: torch.device) -> None:
    """Rollout time with each telemetry profile, as a ratio to telemetry off."""
    import tempfile
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from esper.callbacks.profiles import PROFILES
    from esper.callbacks.telemetry import TelemetryCallback

    n_envs = min(args.n_envs)
    torch.manual_seed(0)
    collector = build(n_envs, args, device)
    for _ in range(TELEMETRY_WARMUP_ROLLOUTS):
        collector.collect_batch(0)
    module = SimpleNamespace(env=collector.env, collector=collector)
    rollout = 1

    def timed(callback: TelemetryCallback | None, trainer: L.Trainer | None) -> tuple[float, float]:
        """Median rollout seconds, and median seconds spent inside the telemetry hooks."""
        nonlocal rollout
        seconds, in_hooks = [], []
        for _ in range(args.repeats):
            hook_s = 0.0

            def hook(fn: Callable[..., None], *hook_args: object) -> None:
                nonlocal hook_s
                tick = time.perf_counter()
                fn(trainer, module, *hook_args)
                hook_s += time.perf_counter() - tick

            synchronize(device)
            start = time.perf_counter()
            if callback is None:
                collector.collect_batch(rollout)
            else:
                hook(callback.on_rollout_start, rollout)
                _, summary = collector.collect_batch(
                    rollout, on_step=lambda s: hook(callback.on_env_step, s)
                )
                hook(callback.on_rollout_end, summary)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
            in_hooks.append(hook_s)
            rollout += 1
        return statistics.median(seconds), statistics.median(in_hooks)

    off, _ = timed(None, None)
    results: dict[str, tuple[float, float]] = {}
    for profile in PROFILES:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(
                default_root_dir=tmp, logger=TensorBoardLogger(tmp), enable_progress_bar=False
            )
            callback = TelemetryCallback(profile=profile)
            callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
            results[profile] = timed(callback, trainer)
            callback.teardown(trainer, module, "fit")  # type: ignore[arg-type]
            trainer.logger.finalize("success")  # type: ignore[union-attr]
    # Off is timed before and after the profiles; their mean cancels slow drift.
    off = (off + timed(None, None)[0]) / 2
    print(f"\ntelemetry cost, n_envs={n_envs}, median of {args.repeats} rollouts:")
    print(
        f"{'profile':>8} | {'rollout s':>9} | {'ratio to off':>12} | "
        f"{'in hooks ms':>11} | {'hooks / rollout':>15}"
    )
    print(f"{'off':>8} | {off:>9.3f} | {1.0:>12.3f} | {0.0:>11.2f} | {0.0:>14.3%}")
    for profile, (seconds, hooks) in results.items():
        print(
            f"{profile:>8} | {seconds:>9.3f} | {seconds / off:>12.3f} | "
            f"{hooks * 1e3:>11.2f} | {hooks / seconds:>14.3%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--data", default="digits", help="registered data module name")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--episode-epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--n-envs", type=int, nargs="+", default=list(N_ENVS))
    parser.add_argument("--telemetry", action="store_true", help="also time each telemetry profile")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="issue 16: wall per PPO update vs pure host compute (benchmarks/rollout_overhead.py)",
    )
    parser.add_argument("--updates", type=int, default=3, help="--overhead: timed updates")
    parser.add_argument("--warmup", type=int, default=1, help="--overhead: untimed updates")
    parser.add_argument("--hosts", nargs="+", help="--overhead: predecessor and/or default")
    parser.add_argument("--threads", type=int, nargs="+", help="--overhead: torch thread counts")
    parser.add_argument(
        "--cpu-workers", type=int, help="--overhead: EnvConfig.cpu_workers (default: every core)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--overhead: alternate the thread counts this many times per case (medians)",
    )
    parser.add_argument(
        "--wall-only",
        action="store_true",
        help="--overhead: time the updates alone, no pure or run_epoch figures beside them",
    )
    args = parser.parse_args()
    quiet_third_party()  # the figures, without Lightning's advert and torch's notice
    if args.overhead:
        from rollout_overhead import print_overhead

        n_envs = [4, 8] if args.n_envs == list(N_ENVS) else args.n_envs
        print_overhead(
            n_envs,
            args.episode_epochs,
            args.updates,
            args.warmup,
            args.hosts,
            args.threads,
            args.cpu_workers,
            args.rounds,
            args.wall_only,
        )
        return
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"rollout benchmark: data={args.data}, episode_epochs={args.episode_epochs}, "
        f"batch_size={args.batch_size}, device={name}, torch threads={torch.get_num_threads()}"
    )
    print(
        f"{'n_envs':>6} | {'env steps/s':>11} | {'host epochs/s':>13} | "
        f"{'reads/host epoch':>16} | {'outside host training':>21} | {'rollout s':>9}"
    )
    for n_envs in args.n_envs:
        m = measure(n_envs, args, device)
        print(
            f"{n_envs:>6} | {m['env_steps_per_s']:>11.2f} | {m['host_epochs_per_s']:>13.2f} | "
            f"{m['reads_per_host_epoch']:>16.2f} | {m['outside_training']:>20.1%} | "
            f"{m['rollout_s']:>9.2f}"
        )
    if args.telemetry:
        telemetry_costs(args, device)


if __name__ == "__main__":
    main()
