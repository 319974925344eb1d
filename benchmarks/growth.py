"""Can growth pay? Paired episodes of growers against the controls, no learning.

Every controller runs the same ``--episodes`` fresh hosts (same initial weights, data
order and seed initialisations: ``esper.evaluation.comparison.compare`` pairs them), on the
default data and host unless told otherwise. The grower the static controls copy is
the scripted one (``--grower``): ``static_final`` trains each of its episodes' final
networks from the first epoch, ``static_equal`` the plain host widened to its mean
final size. For each controller it prints the final test accuracy with its 95%
interval, validation accuracy beside it, the paired differences to no growth and to the
grower (standard errors count each episode group once), the final network's parameters
and its training FLOPs, and how settled the hosts are at the end: the largest change in
validation accuracy between consecutive epochs over the last ``SETTLE_EPOCHS`` epochs,
as a mean and a maximum over episodes.

Evaluation seeds: tune on the tuning range (the default, 0), report on the reporting
range (``--seed 1000``). "Growth pays" means the difference is above 2 standard errors.
The exit status is 0 either way: this measures, it does not gate.

Usage: ``python benchmarks/growth.py [--episodes 16] [--controllers scripted,no_growth]
[--host-kwargs '{"channels": [4, 8, 16]}'] [--data digits] [--episode-epochs 25]
[--blueprints widen] [--widen-init gradient] [--plant-from 4] [--seed 0] [--out runs/growth]``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from esper.contracts.evaluation import TUNING_SEEDS, seed_range
from esper.evaluation.comparison import ControllerSpec, Evaluation, compare
from esper.kasmina import LifecycleConfig, OptimConfig
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig
from esper.simic.module import PPOModule
from esper.tamiyo.heuristic import HeuristicController
from esper.tamiyo.periodic import periodic_config
from esper.tolaria.data import DATAMODULES

#: Epochs at the end of an episode over which a host should have settled.
SETTLE_EPOCHS = 5
#: What runs unless told otherwise: the scripted grower and every control.
CONTROLLERS = "scripted,static_final,static_equal,periodic,random,no_growth"
#: Discounting for the advantages the collector computes: the training defaults (the
#: printed return is the plain sum of rewards either way).


def late_swings(evaluation: Evaluation, controller: str) -> np.ndarray:
    """``[episodes]`` largest |change| of validation accuracy between consecutive epochs
    over the last :data:`SETTLE_EPOCHS` epochs of each of ``controller``'s episodes."""
    curves = []
    for steps in evaluation.steps[controller]:
        val = np.stack([s.val_acc for s in steps] + [steps[-1].next_val_acc], axis=1)
        curves.append(val)
    late = np.concatenate(curves)[:, -(SETTLE_EPOCHS + 1) :]
    episodes = next(r.episodes for r in evaluation.results if r.controller == controller)
    return np.abs(np.diff(late, axis=1)).max(axis=1)[:episodes]


def planting_from(first: int, env: MorphogeneticVecEnv) -> HeuristicController:
    """The periodic control planting after host epochs ``first``, ``first + 1``, ... (one
    seed per slot, at consecutive decisions) and otherwise as ``periodic``: fossilize as
    soon as the gates allow, never prune."""
    epochs = env.config.episode_epochs
    schedule = range(first, first + len(env.schema.slot_ids))
    if schedule[-1] >= epochs:
        raise SystemExit(f"--plant-from {first}: the last planting must be before epoch {epochs}")
    config = periodic_config(env.schema, epochs, env.config.lifecycle)
    at = tuple(epoch / epochs for epoch in schedule)
    controller = HeuristicController(env.layout, env.schema, replace(config, germinate_at=at))
    return controller.to(env.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--controllers", default=CONTROLLERS)
    parser.add_argument("--grower", default="scripted", help="the grower static controls copy")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--host", default=None, help="default: PPOModule's")
    parser.add_argument("--host-kwargs", default=None, help="JSON; default: PPOModule's")
    parser.add_argument("--n-envs", type=int, default=None, help="default: PPOModule's")
    parser.add_argument("--host-optim", default=None, help="JSON of OptimConfig fields")
    parser.add_argument("--lifecycle", default=None, help="JSON of LifecycleConfig fields")
    parser.add_argument(
        "--blueprints", default=None, help="comma-separated; default: the host's own list"
    )
    parser.add_argument(
        "--widen-init", default=None, help="random or gradient; default: PPOModule's"
    )
    parser.add_argument("--data-kwargs", default=None, help="JSON of data module arguments")
    parser.add_argument("--episode-epochs", type=int, default=None)
    parser.add_argument(
        "--plant-from",
        type=int,
        default=None,
        help="periodic plants at the decisions after host epochs K, K+1, ... (one per "
        "slot) instead of its even schedule: growth at a chosen time, for the frontier",
    )
    parser.add_argument("--seed", type=int, default=TUNING_SEEDS.start)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="write evaluation.csv/json here")
    args = parser.parse_args()

    defaults = PPOModule(host=args.host or "cnn").env_config  # what `esper fit` would make
    overrides = {
        "host": args.host,
        "host_kwargs": json.loads(args.host_kwargs) if args.host_kwargs else None,
        "n_envs": args.n_envs,
        "episode_epochs": args.episode_epochs,
        "optim": OptimConfig(**json.loads(args.host_optim)) if args.host_optim else None,
        "lifecycle": LifecycleConfig(**json.loads(args.lifecycle)) if args.lifecycle else None,
        "blueprints": tuple(args.blueprints.split(",")) if args.blueprints else None,
        "widen_init": args.widen_init,
    }
    config = EnvConfig(
        **{
            **{f: getattr(defaults, f) for f in defaults.__dataclass_fields__},
            **{k: v for k, v in overrides.items() if v is not None},
        }
    )
    data = DATAMODULES.get(args.data)(**(json.loads(args.data_kwargs) if args.data_kwargs else {}))
    names = [c for c in args.controllers.split(",") if c]
    print(
        f"growth: {args.episodes} paired episodes, evaluation seed {args.seed} "
        f"({seed_range(args.seed)} range), data {args.data}, host {config.host} "
        f"{dict(config.host_kwargs)}, {config.n_envs} envs, {config.episode_epochs} epochs, "
        f"blueprints {config.blueprints or 'the host default'}, widen_init {config.widen_init}, "
        f"host optim {config.optim}, {config.lifecycle}, threads {torch.get_num_threads()}",
        flush=True,
    )
    specs = {}
    if args.plant_from is not None:
        specs["periodic"] = ControllerSpec(lambda env: planting_from(args.plant_from, env))
    evaluation = compare(
        config,
        data,
        names,
        episodes=args.episodes,
        seed=args.seed,
        device=args.device,
        grower=args.grower,
        specs=specs,
        on_controller_done=lambda r: print(f"  {r.controller:<13} {r.wall_s:6.1f} s", flush=True),
    )
    print(evaluation.table())
    if evaluation.static_equal_host_kwargs is not None:
        print(f"static_equal host: {evaluation.static_equal_host_kwargs}")
    print("late swing of validation accuracy (mean / max over episodes):")
    for r in evaluation.results:
        swing = late_swings(evaluation, r.controller)
        print(f"  {r.controller:<13} {swing.mean() * 100:5.2f} / {swing.max() * 100:.2f} pts")
    if args.out is not None:
        for kind, path in evaluation.write(args.out).items():
            print(f"  {kind:<4} {path}")


if __name__ == "__main__":
    main()
