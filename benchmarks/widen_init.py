"""How should a widening seed's new units start? Paired episodes of the scripted grower.

The scripted grower (``esper.tamiyo.heuristic.SCRIPTED_GROWTH``) plants ``widen`` in every
slot and fossilizes each seed as soon as its gate allows, once with every new unit drawn
at random (``widen_init random``: outgoing weights zero, incoming drawn as a layer's
default init) and once with the units chosen by the loss gradient (``widen_init
gradient``: the quarter of four times as many candidates whose outgoing weights get the
largest gradient on the host's last batch; ``esper.kasmina.widen_init``). Both runs use
the same evaluation seed, so episode ``i`` starts from the same host and data order under
each; the printed difference is paired per episode, its standard error counting each
episode group once. Final test accuracy, which no choice here reads. Tune on the tuning
range (the default seed, 0).

Usage: ``python benchmarks/widen_init.py [--episodes 32] [--seed 0] [--data digits]
[--host-kwargs JSON] [--data-kwargs JSON] [--host cnn]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from esper.contracts.evaluation import TUNING_SEEDS, seed_range
from esper.evaluation.comparison import compare
from esper.report.statistics import paired_difference
from esper.simic.module import PPOModule
from esper.tolaria.data import DATAMODULES

INITS = ("random", "gradient")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=TUNING_SEEDS.start)
    parser.add_argument("--data", default="digits")
    parser.add_argument("--host", default=None, help="default: PPOModule's")
    parser.add_argument("--host-kwargs", default=None, help="JSON; default: PPOModule's")
    parser.add_argument("--data-kwargs", default=None, help="JSON of data module arguments")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    module = PPOModule(
        host=args.host or "cnn",
        host_kwargs=json.loads(args.host_kwargs) if args.host_kwargs else None,
    )
    base = dataclasses.replace(module.env_config, blueprints=("widen",))
    data = DATAMODULES.get(args.data)(**(json.loads(args.data_kwargs) if args.data_kwargs else {}))
    print(
        f"widen_init: {args.episodes} paired episodes of the scripted grower planting widen, "
        f"seed {args.seed} ({seed_range(args.seed)} range), data {args.data}, host "
        f"{base.host} {dict(base.host_kwargs)}, threads {torch.get_num_threads()}",
        flush=True,
    )
    results = {}
    for init in INITS:
        controllers = ["scripted", "no_growth"] if init == INITS[0] else ["scripted"]
        evaluation = compare(
            dataclasses.replace(base, widen_init=init),
            data,
            controllers,
            episodes=args.episodes,
            seed=args.seed,
            device=args.device,
        )
        for r in evaluation.results:
            name = f"{r.controller}" + (f" ({init})" if r.controller == "scripted" else "")
            results[name] = r
        groups = evaluation.groups
    print(f"{'controller':<20} {'test acc [95% CI]':>24} {'params':>7} {'train GFLOP':>11}")
    for name, r in results.items():
        print(
            f"{name:<20} {r.test.mean:>7.4f} [{r.test.low:.4f}, {r.test.high:.4f}] "
            f"{r.params_final_mean:>7.0f} {r.train_flops_mean / 1e9:>11.3f}"
        )
    a, b = (results[f"scripted ({init})"].final_test_acc for init in INITS)
    base_acc = results["no_growth"].final_test_acc
    for label, x, y in (
        ("gradient − random", b, a),
        ("random − no growth", a, base_acc),
        ("gradient − no growth", b, base_acc),
    ):
        d = paired_difference(x, y, groups)
        print(
            f"{label:<22} {d.mean * 100:+.2f} ± {d.se * 100:.2f} pts "
            f"(95% CI {d.low * 100:+.2f} to {d.high * 100:+.2f})"
        )


if __name__ == "__main__":
    main()
