"""Time ``compute_gae`` against the step-by-step loop it replaced and against TorchRL.

Three implementations of one contract (``[n_envs, T]`` rewards, values, next values,
terminated and done flags in; advantages and returns out, on the same device):

* ``compute_gae``: esper's, as a user calls it (``backend="auto"``): on the CPU the C
  kernel built with the package when it was built (the header line says which ran);
* ``torch path``: ``compute_gae(..., backend="torch")``, the tensor-ops solver used on
  CUDA and wherever the kernel was not built: a chunked sweep of about ``2 * sqrt(T)``
  steps;
* the baseline: one reverse sweep over ``T``, vectorised over envs (one small kernel per
  step). It skips the input checks ``compute_gae`` makes, so the ratios slightly favour it;
* TorchRL's ``vec_generalized_advantage_estimate``, if ``torchrl`` is installed
  (``pip install -e .[bench]``); it takes ``[n_envs, T, 1]`` tensors.

Timed: one call, nothing else (inputs are built beforehand). The implementations are
interleaved, call by call, so a drift in the machine's speed hits each of them alike; the
figure is the median. On CUDA the device is synchronised before and after each call.

Before timing, every implementation's advantages are compared with a plain per-env,
per-step reference computed in float64 Python arithmetic; the largest difference is
printed, and the script fails if that of ``compute_gae`` or of the torch path exceeds
``--tolerance``.

With ``--solvers`` it times something else: the two tensor-ops solvers esper had, against
each other, bare (no input checks), on the shapes esper runs (``T`` = decisions per
episode, 24 to 60; ``E`` = 4 to 64 envs) and on long trajectories (``T`` = 256, 1024): the
chunked sweep esper keeps (``esper.simic.gae._gae_by_chunks``) and the discount-matrix
product it dropped, kept below (:func:`discount_matrix_gae`) so that the measurement that
dropped it can be run again. Calls alternate in order from round to round; the ratio is
the median over rounds of (chunked sweep / discount matrices) within a round, with its
quartiles, so a drift in the machine's speed cancels out.

    python benchmarks/gae.py [--threads 1] [--device cpu|cuda] [--repeats 15] [--solvers]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

# Time this checkout's code, whether or not esper is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from esper.simic import gae_native
from esper.simic.gae import _gae_by_chunks, compute_gae

try:
    from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
except ImportError:  # optional: pip install -e .[bench]
    vec_generalized_advantage_estimate = None

#: (n_envs, T): a default rollout, a large one, and a very large one.
SHAPES = ((4, 25), (64, 150), (1024, 1000))
#: (n_envs, T) for ``--solvers``: esper's episodes (24 to 60 decisions, 4 to 64 envs),
#: then long trajectories.
SOLVER_SHAPES = tuple((e, t) for t in (24, 60, 256, 1024) for e in (4, 16, 64))
DEFAULT_REPEATS = 15
#: TorchRL takes seconds a call at the largest shape; fewer calls keep the run short.
DEFAULT_TORCHRL_REPEATS = 5
WARMUP = 2
GAMMA = 0.99
GAE_LAMBDA = 0.95
#: Probability that a step terminates / is truncated in the synthetic rollout.
P_TERMINATED = 0.05
P_TRUNCATED = 0.05
SEED = 0
#: Largest allowed |compute_gae - reference| on float32 inputs.
DEFAULT_TOLERANCE = 1e-5
#: Targets from the issue, checked on the figures of this run.
TARGET_VS_LOOP = 3.0
TARGET_VS_TORCHRL = 50.0

Inputs = dict[str, Tensor]
Gae = Callable[[Inputs], tuple[Tensor, Tensor]]


@torch.no_grad()
def reverse_sweep_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """The baseline: ``A_t = delta_t + decay_t * A_{t+1}``, one step at a time, all envs."""
    not_terminated = (~terminated).to(rewards.dtype)
    carries = (~(done | terminated)).to(rewards.dtype)
    deltas = rewards + gamma * next_values * not_terminated - values
    decays = (gamma * gae_lambda) * carries
    deltas_tm = deltas.T.contiguous()
    decays_tm = decays.T.contiguous()
    advantages_tm = torch.empty_like(deltas_tm)
    following = deltas_tm.new_zeros(deltas_tm.shape[1])
    for t in range(deltas_tm.shape[0] - 1, -1, -1):
        torch.addcmul(deltas_tm[t], decays_tm[t], following, out=advantages_tm[t])
        following = advantages_tm[t]
    advantages = advantages_tm.T.contiguous()
    return advantages, advantages + values


@functools.lru_cache(maxsize=16)
def _discount_powers(
    n_steps: int, decay: float, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``[T, T]`` upper-triangular ``decay ** (k - t)``, cached as esper cached it."""
    steps = torch.arange(n_steps, device=device, dtype=dtype)
    lags = steps.unsqueeze(0) - steps.unsqueeze(1)  # [t, k] = k - t
    return torch.full_like(lags, decay).pow_(lags.clamp(min=0)).triu_()


def discount_matrix_gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """The tensor-ops solver esper dropped (issue 15): ``A_e = M_e @ delta_e`` per env.

    ``M_e[t, k] = (gamma lambda)^(k - t)`` while no stop lies in ``[t, k)``, else 0: one
    ``[n_envs, T, T]`` product, no loop, so ``O(E T^2)`` memory and time. Exactly as it
    was in ``esper.simic.gae`` before it went.
    """
    n_steps = rewards.shape[1]
    deltas = torch.add(rewards, next_values.masked_fill(terminated, 0.0), alpha=gamma)
    deltas.sub_(values)
    stops = done | terminated
    stops_before = stops.cumsum(1).sub_(stops.view(torch.uint8))  # [E, T]: before each step
    same_stretch = stops_before.unsqueeze(2) == stops_before.unsqueeze(1)  # [E, t, k]
    powers = _discount_powers(n_steps, gamma * gae_lambda, rewards.dtype, rewards.device)
    discounts = powers * same_stretch
    advantages = (discounts * deltas.unsqueeze(1)).sum(2)
    return advantages, advantages + values


def reference_advantages(inputs: Inputs) -> Tensor:
    """Per env, per step, in float64 Python arithmetic: the figure everything is held to."""
    rows = {
        k: v.double().tolist() if v.is_floating_point() else v.tolist() for k, v in inputs.items()
    }
    advantages = []
    for e in range(len(rows["rewards"])):
        following, adv = 0.0, [0.0] * len(rows["rewards"][e])
        for t in reversed(range(len(adv))):
            bootstrap = 0.0 if rows["terminated"][e][t] else GAMMA * rows["next_values"][e][t]
            delta = rows["rewards"][e][t] + bootstrap - rows["values"][e][t]
            if rows["done"][e][t] or rows["terminated"][e][t]:
                following = 0.0
            following = adv[t] = delta + GAMMA * GAE_LAMBDA * following
        advantages.append(adv)
    return torch.tensor(advantages, dtype=torch.float64)


def implementations() -> dict[str, Gae]:
    found: dict[str, Gae] = {
        "compute_gae": lambda x: compute_gae(**x, gamma=GAMMA, gae_lambda=GAE_LAMBDA),
        "torch path": lambda x: compute_gae(
            **x, gamma=GAMMA, gae_lambda=GAE_LAMBDA, backend="torch"
        ),
        "loop": lambda x: reverse_sweep_gae(**x, gamma=GAMMA, gae_lambda=GAE_LAMBDA),
    }
    if vec_generalized_advantage_estimate is not None:

        def torchrl(x: Inputs) -> tuple[Tensor, Tensor]:
            adv, ret = vec_generalized_advantage_estimate(
                GAMMA,
                GAE_LAMBDA,
                x["values"].unsqueeze(-1),
                x["next_values"].unsqueeze(-1),
                x["rewards"].unsqueeze(-1),
                x["done"].unsqueeze(-1),
                x["terminated"].unsqueeze(-1),
            )
            return adv.squeeze(-1), ret.squeeze(-1)

        found["torchrl"] = torchrl
    return found


def make_inputs(n_envs: int, n_steps: int, device: torch.device) -> Inputs:
    """float32 rollout with terminations and truncations at random steps (done ⊇ terminated)."""
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


def interleaved_medians(
    fns: dict[str, Gae], inputs: Inputs, device: torch.device, repeats: dict[str, int]
) -> dict[str, float]:
    """Median seconds per call of each implementation, calls interleaved round-robin."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(WARMUP):
            fn(inputs)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(max(repeats.values())):
        for name, fn in fns.items():
            if round_ >= repeats[name]:
                continue
            sync()
            start = time.perf_counter()
            fn(inputs)
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _ms(medians: dict[str, float], name: str) -> str:
    return f"{medians[name] * 1e3:8.3f} ms" if name in medians else f"{'-':>11}"


def paired_rounds(
    fns: dict[str, Gae], inputs: Inputs, device: torch.device, repeats: int
) -> dict[str, list[float]]:
    """Seconds per call of each of two implementations, one call of each per round, the
    order swapped every round so that neither always runs on a cache the other warmed."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(WARMUP):
            fn(inputs)
    order = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        for name in order if round_ % 2 == 0 else reversed(order):
            sync()
            start = time.perf_counter()
            fns[name](inputs)
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def solvers_table(device: torch.device, repeats: int, tolerance: float) -> list[str]:
    """Print the chunked sweep against the discount matrices; returns the failures."""
    fns: dict[str, Gae] = {
        "chunks": lambda x: _gae_by_chunks(**x, gamma=GAMMA, gae_lambda=GAE_LAMBDA),
        "matrices": lambda x: discount_matrix_gae(**x, gamma=GAMMA, gae_lambda=GAE_LAMBDA),
    }
    print(
        f"tensor-ops solvers, bare: 'chunks' is esper.simic.gae._gae_by_chunks (kept), "
        f"'matrices' the discount-matrix product (dropped); {repeats} rounds, one call of "
        "each per round, order alternating; ratio = median over rounds of chunks / matrices "
        "[quartiles]"
    )
    header = (
        f"{'shape':>10} | {'chunks':>11} | {'matrices':>11} | {'chunks / matrices':>28}"
        f" | {'chunks error':>12} | {'matrices error':>14}"
    )
    print(header)
    print("-" * len(header))
    failures = []
    for n_envs, n_steps in SOLVER_SHAPES:
        inputs = make_inputs(n_envs, n_steps, device)
        reference = reference_advantages({k: v.cpu() for k, v in inputs.items()})
        errors = {
            n: (fn(inputs)[0].double().cpu() - reference).abs().max().item()
            for n, fn in fns.items()
        }
        times = paired_rounds(fns, inputs, device, repeats)
        ratios = sorted(c / m for c, m in zip(times["chunks"], times["matrices"], strict=True))
        quartiles = statistics.quantiles(ratios, n=4)
        medians = {n: statistics.median(t) for n, t in times.items()}
        spread = f"{statistics.median(ratios):.3g} [{quartiles[0]:.3g}, {quartiles[2]:.3g}]"
        print(
            f"{n_envs:>4}x{n_steps:<5} | {_ms(medians, 'chunks')} | {_ms(medians, 'matrices')}"
            f" | {spread:>28} | {errors['chunks']:12.1e} | {errors['matrices']:14.1e}"
        )
        failures += [
            f"{n_envs}x{n_steps}: {n} error {e:.1e}" for n, e in errors.items() if e > tolerance
        ]
    return failures


def implementations_table(
    device: torch.device, repeats: int, torchrl_repeats: int, tolerance: float
) -> list[str]:
    """Print compute_gae against the loop and TorchRL; returns the targets missed."""
    fns = implementations()
    probe = make_inputs(1, 1, device)["rewards"]
    backend = (
        "the C kernel esper.simic._gae_kernel"
        if gae_native.supports(probe)
        else "tensor ops (the C kernel "
        + ("does not run on this device)" if gae_native.available() else "is not built)")
    )
    print(f"compute_gae runs {backend}; 'torch path' is compute_gae(..., backend='torch')")
    if "torchrl" not in fns:
        print("torchrl is not installed (pip install -e .[bench]): its column is skipped")
    print(
        f"median of {repeats} interleaved calls "
        f"({torchrl_repeats} for torchrl); error = max |advantage - float64 reference|"
    )
    columns = ("compute_gae", "torch path", "loop", "torchrl")
    header = f"{'shape':>10} | " + " | ".join(f"{c:>11}" for c in columns)
    header += f" | {'vs loop':>7} | {'torch path vs loop':>18} | {'vs torchrl':>10}"
    header += f" | {'error':>7} | {'torch path error':>16} | {'torchrl error':>13}"
    print(header)
    print("-" * len(header))
    failures = []
    counts = {n: torchrl_repeats if n == "torchrl" else repeats for n in fns}
    for n_envs, n_steps in SHAPES:
        inputs = make_inputs(n_envs, n_steps, device)
        reference = reference_advantages({k: v.cpu() for k, v in inputs.items()})
        errors = {
            n: (fn(inputs)[0].double().cpu() - reference).abs().max().item()
            for n, fn in fns.items()
        }
        medians = interleaved_medians(fns, inputs, device, counts)
        vs_loop = medians["loop"] / medians["compute_gae"]
        torch_vs_loop = medians["loop"] / medians["torch path"]
        vs_trl = medians["torchrl"] / medians["compute_gae"] if "torchrl" in fns else None

        row = f"{n_envs:>4}x{n_steps:<5} | " + " | ".join(_ms(medians, c) for c in columns)
        row += f" | {vs_loop:6.1f}x | {torch_vs_loop:17.1f}x | "
        row += f"{vs_trl:9.0f}x" if vs_trl is not None else f"{'-':>10}"
        row += f" | {errors['compute_gae']:7.1e} | {errors['torch path']:16.1e} | "
        row += f"{errors['torchrl']:13.1e}" if "torchrl" in errors else f"{'-':>13}"
        print(row)
        for name in ("compute_gae", "torch path"):
            if errors[name] > tolerance:
                failures.append(f"{n_envs}x{n_steps}: {name} error {errors[name]:.1e}")
        if (n_envs, n_steps) in ((4, 25), (1024, 1000)) and vs_loop < TARGET_VS_LOOP:
            failures.append(f"{n_envs}x{n_steps}: {vs_loop:.1f}x the loop < {TARGET_VS_LOOP}x")
        if (n_envs, n_steps) == (1024, 1000) and vs_trl is not None and vs_trl < TARGET_VS_TORCHRL:
            failures.append(f"{n_envs}x{n_steps}: {vs_trl:.0f}x torchrl < {TARGET_VS_TORCHRL}x")
    if not failures:
        print(
            f"targets met by compute_gae: >= {TARGET_VS_LOOP:.0f}x the loop at 4x25 and "
            f"1024x1000, error <= {tolerance:.0e} (torch path too)"
            + (f", >= {TARGET_VS_TORCHRL:.0f}x torchrl at 1024x1000" if "torchrl" in fns else "")
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--torchrl-repeats", type=int, default=DEFAULT_TORCHRL_REPEATS)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument(
        "--solvers",
        action="store_true",
        help="time the chunked sweep against the dropped discount matrices instead",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"GAE, float32, device={name}, {torch.get_num_threads()} CPU thread(s), "
        f"torch {torch.__version__}, gamma={GAMMA}, lambda={GAE_LAMBDA}, "
        f"P(terminated)={P_TERMINATED}, P(truncated)={P_TRUNCATED}"
    )
    if args.solvers:
        failures = solvers_table(device, args.repeats, args.tolerance)
    else:
        failures = implementations_table(device, args.repeats, args.torchrl_repeats, args.tolerance)
    if failures:
        print("targets missed:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
