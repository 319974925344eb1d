"""Can growth pay? Paired episodes of no growth against controllers that grow, no learning.

Every controller runs the same ``--episodes`` fresh hosts (same initial weights, data
order and seed initialisations: ``esper.simic.episodes.run_episodes`` pairs them), on
the default data and host unless told otherwise. For each controller it prints the
final validation accuracy (mean ± std over episodes), the mean difference to no growth
with its standard error over the paired episodes, seeds fossilized, parameters added,
the mean episode return, and how settled the hosts are at the end: the largest change
in validation accuracy between consecutive epochs over the last ``SETTLE_EPOCHS``
epochs, as a mean and a maximum over episodes.

"Growth pays" means the difference is above 2 standard errors. The exit status is 0
either way: this measures, it does not gate.

Usage: ``python benchmarks/growth.py [--episodes 16] [--controllers scripted,heuristic]
[--host-kwargs '{"channels": [4, 8, 16]}'] [--data digits] [--episode-epochs 25]``
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from esper.kasmina import OptimConfig
from esper.simic.env_config import EnvConfig
from esper.simic.episodes import baseline_controller, run_episodes
from esper.simic.module import PPOModule
from esper.simic.ppo import PPOConfig
from esper.tolaria.data import DATAMODULES

#: Epochs at the end of an episode over which a host should have settled.
SETTLE_EPOCHS = 5
#: The baseline every other controller is paired against.
BASELINE = "no_growth"
#: Discounting for the advantages the collector computes: the training defaults (the
#: printed return is the plain sum of rewards either way).
GAMMA, GAE_LAMBDA = PPOConfig.gamma, PPOConfig.gae_lambda


def paired_difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of ``a - b`` and its standard error (paired episodes)."""
    diff = a - b
    if diff.size < 2:
        return float(diff.mean()), math.nan
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))


def largest_late_swing(val_acc: np.ndarray) -> np.ndarray:
    """``[episodes]`` largest |change| between consecutive epochs over the last epochs."""
    late = val_acc[:, -(SETTLE_EPOCHS + 1) :]
    return np.abs(np.diff(late, axis=1)).max(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--controllers", default="scripted,heuristic")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--host", default=None, help="default: PPOModule's")
    parser.add_argument("--host-kwargs", default=None, help="JSON; default: PPOModule's")
    parser.add_argument("--n-envs", type=int, default=None, help="default: PPOModule's")
    parser.add_argument("--host-optim", default=None, help="JSON of OptimConfig fields")
    parser.add_argument("--data-kwargs", default=None, help="JSON of data module arguments")
    parser.add_argument("--episode-epochs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    defaults = PPOModule().env_config  # the run `esper fit` would make
    overrides = {
        "host": args.host,
        "host_kwargs": json.loads(args.host_kwargs) if args.host_kwargs else None,
        "n_envs": args.n_envs,
        "episode_epochs": args.episode_epochs,
        "optim": OptimConfig(**json.loads(args.host_optim)) if args.host_optim else None,
    }
    config = EnvConfig(
        **{
            **{f: getattr(defaults, f) for f in defaults.__dataclass_fields__},
            **{k: v for k, v in overrides.items() if v is not None},
        }
    )
    data = DATAMODULES.get(args.data)(**(json.loads(args.data_kwargs) if args.data_kwargs else {}))
    names = [BASELINE, *(c for c in args.controllers.split(",") if c and c != BASELINE)]
    print(
        f"growth: {args.episodes} paired episodes, data {args.data}, host {config.host} "
        f"{dict(config.host_kwargs)}, {config.n_envs} envs, {config.episode_epochs} epochs, "
        f"host optim {config.optim}, threads {torch.get_num_threads()}"
    )
    runs = {}
    for name in names:
        start = time.perf_counter()

        runs[name] = run_episodes(
            config,
            data,
            lambda env, name=name: baseline_controller(name, env),
            None,  # the baselines decide on raw features
            episodes=args.episodes,
            seed=args.seed,
            gamma=GAMMA,
            gae_lambda=GAE_LAMBDA,
            device=args.device,
        )
        print(f"  {name:<10} {time.perf_counter() - start:6.1f} s", flush=True)

    base = runs[BASELINE].per_episode["final_val_acc"]
    header = (
        f"{'controller':<10} {'final val acc (mean ± std)':>27} {'vs no growth (± SE)':>22} "
        f"{'foss':>5} {'params':>7} {'return':>8} {'late swing mean/max':>20}"
    )
    print(header)
    print("-" * len(header))
    for name, run in runs.items():
        acc = run.per_episode["final_val_acc"]
        diff, se = paired_difference(acc, base)
        swing = largest_late_swing(run.val_acc)
        versus = "" if name == BASELINE else f"{diff * 100:+.2f} ± {se * 100:.2f} pts"
        print(
            f"{name:<10} {acc.mean():>17.4f} ± {acc.std(ddof=1):.4f} {versus:>22} "
            f"{run.per_episode['seeds_fossilized'].mean():>5.2f} "
            f"{run.per_episode['params_added'].mean():>7.0f} "
            f"{run.per_episode['episode_return'].mean():>+8.4f} "
            f"{swing.mean() * 100:>9.2f}/{swing.max() * 100:.2f} pts"
        )


if __name__ == "__main__":
    main()
