"""Time ``compute_gae`` (one sweep for all envs) against a per-env Python-loop GAE.

Both sides take the same ``[n_envs, T]`` tensors on the same device and return
advantages and returns there. The reference is the shape of the earlier system's code:
a Python loop over envs and, inside it, over steps, with one tensor op per term; it
reads nothing on the host either, so the comparison is loop structure, not syncs.

Timed: the call alone (inputs are built and checked for agreement beforehand). On CUDA
the device is synchronised before starting and after finishing each call, so a time
covers the kernels, not just their launch.

    python benchmarks/gae.py [--device cpu|cuda] [--repeats 15] [--steps 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

# Time this checkout's code, whether or not esper is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from esper.simic.gae import compute_gae

ENV_COUNTS = (4, 64, 256)
DEFAULT_STEPS = 25  # one episode: the default episode_epochs
DEFAULT_REPEATS = 15
WARMUP = 3
GAMMA = 0.99
GAE_LAMBDA = 0.95
#: Probability that a step terminates / is truncated in the synthetic rollout.
P_TERMINATED = 0.05
P_TRUNCATED = 0.05
SEED = 0
#: Agreement required between the two implementations before timing them (float32).
AGREE_ATOL = 1e-4


def per_env_loop_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Same contract as ``compute_gae``, one env and one step at a time."""
    advantages = torch.empty_like(rewards)
    not_terminated = (~terminated).to(rewards.dtype)
    carries = (~(done | terminated)).to(rewards.dtype)
    for e in range(rewards.shape[0]):
        following = rewards.new_zeros(())
        for t in range(rewards.shape[1] - 1, -1, -1):
            delta = rewards[e, t] + gamma * next_values[e, t] * not_terminated[e, t] - values[e, t]
            following = delta + gamma * gae_lambda * carries[e, t] * following
            advantages[e, t] = following
    return advantages, advantages + values


def make_inputs(n_envs: int, n_steps: int, device: torch.device) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(SEED)
    terminated = torch.rand(n_envs, n_steps, generator=g) < P_TERMINATED
    truncated = torch.rand(n_envs, n_steps, generator=g) < P_TRUNCATED
    inputs = {
        "rewards": torch.randn(n_envs, n_steps, generator=g),
        "values": torch.randn(n_envs, n_steps, generator=g),
        "next_values": torch.randn(n_envs, n_steps, generator=g),
        "terminated": terminated,
        "done": terminated | truncated,
    }
    return {k: v.to(device) for k, v in inputs.items()}


def median_seconds(
    fn: Callable[..., tuple[Tensor, Tensor]],
    inputs: dict[str, Tensor],
    device: torch.device,
    repeats: int,
) -> float:
    """Median wall time of ``fn(**inputs, gamma, gae_lambda)`` alone, device work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(WARMUP):
        fn(**inputs, gamma=GAMMA, gae_lambda=GAE_LAMBDA)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn(**inputs, gamma=GAMMA, gae_lambda=GAE_LAMBDA)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"GAE, T={args.steps}, float32, device={name}, median of {args.repeats} calls")
    print(f"{'n_envs':>6} | {'compute_gae':>12} | {'per-env loop':>12} | {'speed-up':>8}")
    print(f"{'-' * 6}-+-{'-' * 12}-+-{'-' * 12}-+-{'-' * 8}")
    for n_envs in ENV_COUNTS:
        inputs = make_inputs(n_envs, args.steps, device)
        fast = compute_gae(**inputs, gamma=GAMMA, gae_lambda=GAE_LAMBDA)
        slow = per_env_loop_gae(**inputs, gamma=GAMMA, gae_lambda=GAE_LAMBDA)
        for a, b in zip(fast, slow, strict=True):
            torch.testing.assert_close(a, b, atol=AGREE_ATOL, rtol=0)
        vectorised = median_seconds(compute_gae, inputs, device, args.repeats)
        looped = median_seconds(per_env_loop_gae, inputs, device, args.repeats)
        print(
            f"{n_envs:>6} | {vectorised * 1e3:>9.3f} ms | {looped * 1e3:>9.3f} ms | "
            f"{looped / vectorised:>7.0f}x"
        )


if __name__ == "__main__":
    main()
