"""Does the policy learn to grow? ``esper fit`` end to end, then paired evaluations.

For each training seed this runs ``esper fit`` (its defaults, plus ``--fit-args``) as a
subprocess, with a checkpoint every ``--every`` PPO updates beside the run's own
``last.ckpt``. It then evaluates, on the same ``--episodes`` fresh hosts for every
controller (``esper.evaluation.evaluate``: same initial weights, data order and seed
initialisations), on the test split:

* the final policy, taking each head's most likely action, against every control and
  grower (its final networks trained from the start, the plain host widened to its
  size, a fixed schedule, the heuristic, the scripted grower, random growth, no
  growth): the paired table, each row with its difference to no growth and to the
  learned policy, standard errors counting each episode group once; and sampled;
* every checkpoint along the way (most likely action): the learning curve of
  learned − no growth against PPO updates.

Evaluation seeds: the tuning range by default (``--eval-seed 0``); figures to report
come from the reporting range (``--eval-seed 1000``). "Learned beats no growth" means
the difference is above 2 standard errors. Figures are printed and written to
``<out>/learning.json``; the curve is drawn to ``<out>/learned_vs_no_growth.png`` and each
seed's final evaluation (CSV, JSON, timelines) goes to ``<out>/seed<N>/evaluation``.
The exit status is 0 either way: this measures, it does not gate.

Usage: ``python benchmarks/learning.py [--seeds 0,1] [--episodes 16] [--every 10]
[--eval-seed 0] [--out runs/learning] [--fit-args "--trainer.max_epochs 40"]
[--skip-fit] [--no-curve]``
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from esper.callbacks.checkpoint import find_last_checkpoint
from esper.contracts.evaluation import ALL_CONTROLLERS, NO_GROWTH, TUNING_SEEDS, seed_range
from esper.evaluation.comparison import ControllerResult, Evaluation
from esper.evaluation.evaluate import evaluate
from esper.report.statistics import Estimate, paired_difference

#: What the final policy is compared with: every controller there is.
COMPARED: tuple[str, ...] = ALL_CONTROLLERS
#: Where the curve checkpoints go inside a run folder, and how they are named.
CURVE_DIR = "curve"
CURVE_NAME = re.compile(r"update(\d+)\.ckpt$")


def fit(seed: int, run_dir: Path, every: int, extra: list[str]) -> float:
    """Run ``esper fit`` for one training seed; returns its wall time in seconds."""
    command = [
        sys.executable,
        "-m",
        "esper",
        "fit",
        "--seed_everything",
        str(seed),
        "--trainer.default_root_dir",
        str(run_dir),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={run_dir / CURVE_DIR}",
        f"--trainer.callbacks.every_n_epochs={every}",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.auto_insert_metric_name=false",
        "--trainer.callbacks.filename=update{epoch:04d}",
        *extra,
    ]
    print("$ " + shlex.join(command), flush=True)
    start = time.perf_counter()
    with (run_dir / "fit.log").open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def curve_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(updates completed, path)`` of each checkpoint along the way, in order."""
    found = []
    for path in (run_dir / CURVE_DIR).glob("update*.ckpt"):
        match = CURVE_NAME.search(path.name)
        if match:  # the file names the 0-based epoch: epoch k ends update k + 1
            found.append((int(match.group(1)) + 1, path))
    return sorted(found)


def versus(r: ControllerResult, reference: ControllerResult, groups: tuple[int, ...]) -> Estimate:
    """Paired difference of final test accuracy, each episode group one unit."""
    return paired_difference(r.final_test_acc, reference.final_test_acc, groups)


def one_seed(seed: int, args: argparse.Namespace, extra: list[str]) -> dict[str, object]:
    run_dir = args.out / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    fit_s = None if args.skip_fit else fit(seed, run_dir, args.every, extra)
    last = find_last_checkpoint(run_dir)
    if last is None:
        raise FileNotFoundError(
            f"no last.ckpt under {run_dir}: did `esper fit` finish? See {run_dir}/fit.log"
        )
    if fit_s is not None:
        print(f"seed {seed}: esper fit took {fit_s / 60:.1f} min", flush=True)

    def run(ckpt: Path, controllers: tuple[str, ...], sample: bool = False) -> Evaluation:
        start = time.perf_counter()
        result = evaluate(
            ckpt,
            episodes=args.episodes,
            seed=args.eval_seed,
            controllers=controllers,
            sample=sample,
        )
        print(
            f"  evaluated {','.join(controllers)}{' (sampled)' if sample else ''} on {ckpt.name} "
            f"in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        return result

    final = run(last, COMPARED)
    final.write(run_dir / "evaluation")
    by_name = {r.controller: r for r in final.results}
    reference = by_name[NO_GROWTH]
    sampled = run(last, ("learned",), sample=True).results[0]
    sampled_vs = versus(sampled, reference, final.groups)
    curve = []
    for updates, ckpt in curve_checkpoints(run_dir) if args.curve else []:
        r = run(ckpt, ("learned",)).results[0]
        est = versus(r, reference, final.groups)
        curve.append(
            {
                "updates": updates,
                "diff": est.mean,
                "se": est.se,
                "fossilized": r.seeds_fossilized_mean,
            }
        )
    print(
        f"\nseed {seed}: {args.episodes} paired episodes (evaluation seed {args.eval_seed}, "
        f"{seed_range(args.eval_seed)} range), {last}"
    )
    print(final.table())
    print(
        f"learned, sampled: test acc {sampled.test.mean:.4f}, − no growth "
        f"{sampled_vs.mean * 100:+.2f} ± {sampled_vs.se * 100:.2f} pts"
    )
    if curve:
        print("learning curve (learned, most likely action, − no growth, test accuracy):")
    for point in curve:
        print(
            f"  update {point['updates']:>4}: {point['diff'] * 100:+.2f} ± {point['se'] * 100:.2f} pts, "
            f"{point['fossilized']:.2f} fossilized"
        )
    if args.curve:  # pictures of the final policy beside the curve (4 episodes)
        ev = evaluate(
            last,
            episodes=min(args.episodes, 4),
            seed=args.eval_seed,
            controllers=("learned", NO_GROWTH),
        )
        ev.write_timelines(run_dir / "evaluation" / "timelines")
    return {
        "seed": seed,
        "fit_s": fit_s,
        "rows": final.rows(),
        "learned_sampled": {"test_acc": sampled.test.mean, "vs_no_growth": vars(sampled_vs)},
        "curve": curve,
        "episode_group": list(final.groups),
        "final_test_acc": {
            "learned_sampled": sampled.final_test_acc,
            **{r.controller: r.final_test_acc for r in final.results},
        },
    }


def draw_curve(results: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for res in results:
        pts = res["curve"]
        x = [p["updates"] for p in pts]
        y = np.array([p["diff"] for p in pts]) * 100
        e = np.array([p["se"] for p in pts]) * 100
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=f"training seed {res['seed']}")
    ax.axhline(0.0, color="grey", linestyle="--", label="no growth")
    ax.set_xlabel("PPO updates")
    ax.set_ylabel("learned − no growth (pts, ± SE)")
    ax.set_title("Final test accuracy gained by the learned policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1", help="training seeds, comma-separated")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument(
        "--every", type=int, default=10, help="PPO updates between curve checkpoints"
    )
    parser.add_argument(
        "--eval-seed",
        type=int,
        default=TUNING_SEEDS.start,
        help="evaluation seed: tuning range by default; report with one of the reporting range",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument("--fit-args", default="", help="extra `esper fit` arguments, one string")
    parser.add_argument("--skip-fit", action="store_true", help="evaluate runs already in --out")
    parser.add_argument(
        "--no-curve", dest="curve", action="store_false", help="evaluate the final policy only"
    )
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    extra = shlex.split(args.fit_args)
    print(
        f"learning: training seeds {seeds}, {args.episodes} paired episodes, "
        f"threads {torch.get_num_threads()}, fit args {extra}",
        flush=True,
    )
    results = [one_seed(seed, args, extra) for seed in seeds]
    if len(results) > 1:
        print(f"\nacross {len(results)} training seeds (mean ± SE over seeds of each seed's mean):")
        for name in COMPARED:
            if name == NO_GROWTH:
                continue
            diffs = np.array(
                [
                    next(r for r in res["rows"] if r["controller"] == name)["vs_no_growth_mean"]
                    for res in results
                ]
            )
            print(
                f"  {name:<13} − no growth: {diffs.mean() * 100:+.2f} ± "
                f"{diffs.std(ddof=1) / math.sqrt(diffs.size) * 100:.2f} pts"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(results, indent=2, default=float))
    print(f"wrote {args.out / 'learning.json'}")
    if args.curve:
        draw_curve(results, args.out / "learned_vs_no_growth.png")
        print(f"wrote {args.out / 'learned_vs_no_growth.png'}")


if __name__ == "__main__":
    main()
