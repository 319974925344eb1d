"""Does the policy learn to grow? ``esper fit`` end to end, then paired evaluations.

For each training seed this runs ``esper fit`` (its defaults, plus ``--fit-args``) as a
subprocess, with a checkpoint every ``--every`` PPO updates beside the run's own
``last.ckpt``. It then evaluates, on the same ``--episodes`` fresh hosts for every
controller (``esper.simic.evaluate``: same initial weights, data order and seed
initialisations):

* the final policy, taking each head's most likely action and sampling it, against no
  growth, the heuristic and the scripted grower: the paired table, with each
  controller's mean difference to no growth and its standard error;
* every checkpoint along the way (most likely action): the learning curve of
  learned − no growth against PPO updates.

"Learned beats no growth" means the difference is above 2 standard errors. Figures are
printed and written to ``<out>/learning.json``; the curve is drawn to
``<out>/learning_curve.png`` and each seed's final evaluation (CSV, JSON, timelines)
goes to ``<out>/seed<N>/evaluation``. The exit status is 0 either way: this measures,
it does not gate.

Usage: ``python benchmarks/learning.py [--seeds 0,1] [--episodes 16] [--every 10]
[--out runs/learning] [--fit-args "--trainer.max_epochs 40"] [--skip-fit]``
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
from esper.simic.evaluate import (
    REFERENCE,
    ControllerResult,
    evaluate,
    standard_error_of_difference,
)

#: Controllers that need no policy: the same for every checkpoint, so run once per seed.
FIXED = ("no_growth", "heuristic", "scripted")
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


def paired(result: ControllerResult, reference: ControllerResult) -> tuple[float, float]:
    return standard_error_of_difference(result.final_val_acc, reference.final_val_acc)


def row(name: str, r: ControllerResult, reference: ControllerResult) -> dict[str, float | str]:
    diff, se = paired(r, reference) if r is not reference else (math.nan, math.nan)
    return {
        "controller": name,
        "final_val_acc_mean": r.final_val_acc_mean,
        "final_val_acc_std": r.final_val_acc_std,
        "vs_no_growth_mean": diff,
        "vs_no_growth_se": se,
        "seeds_fossilized_mean": r.seeds_fossilized_mean,
        "params_added_mean": r.params_added_mean,
        "return_mean": r.return_mean,
    }


def print_table(rows: list[dict[str, float | str]]) -> None:
    header = (
        f"{'controller':<16} {'final val acc (mean ± std)':>26} {'− no growth (mean ± SE)':>26} "
        f"{'foss':>5} {'params':>7} {'return':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        diff, se = float(r["vs_no_growth_mean"]), float(r["vs_no_growth_se"])
        ratio = f" ({diff / se:+.1f} SE)" if se > 0 else " (no difference in any episode)"
        versus = "" if math.isnan(diff) else f"{diff * 100:+.2f} ± {se * 100:.2f} pts{ratio}"
        print(
            f"{r['controller']:<16} {r['final_val_acc_mean']:>17.4f} ± {r['final_val_acc_std']:.4f} "
            f"{versus:>26} {r['seeds_fossilized_mean']:>5.2f} {r['params_added_mean']:>7.0f} "
            f"{r['return_mean']:>+8.4f}"
        )


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

    def run(
        ckpt: Path, controllers: tuple[str, ...], sample: bool = False
    ) -> list[ControllerResult]:
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
        return result.results

    fixed = {r.controller: r for r in run(last, FIXED)}
    final = run(last, ("learned",))[0]
    sampled = run(last, ("learned",), sample=True)[0]
    reference = fixed[REFERENCE]
    rows = [
        row("learned", final, reference),
        row("learned, sampled", sampled, reference),
        *(row(name, fixed[name], reference) for name in FIXED),
    ]
    learned_vs_heuristic = standard_error_of_difference(
        final.final_val_acc, fixed["heuristic"].final_val_acc
    )
    curve = []
    for updates, ckpt in curve_checkpoints(run_dir) if args.curve else []:
        r = run(ckpt, ("learned",))[0]
        diff, se = paired(r, reference)
        curve.append(
            {"updates": updates, "diff": diff, "se": se, "fossilized": r.seeds_fossilized_mean}
        )
    print(
        f"\nseed {seed}: {args.episodes} paired episodes (evaluation seed {args.eval_seed}), {last}"
    )
    print_table(rows)
    diff, se = learned_vs_heuristic
    print(f"learned − heuristic: {diff * 100:+.2f} ± {se * 100:.2f} pts")
    print("learning curve (learned, most likely action, − no growth):")
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
            controllers=("learned", "no_growth"),
        )
        ev.write_timelines(run_dir / "evaluation" / "timelines")
    return {
        "seed": seed,
        "fit_s": fit_s,
        "rows": rows,
        "learned_vs_heuristic": {"mean": diff, "se": se},
        "curve": curve,
        "final_val_acc": {
            "learned": final.final_val_acc,
            "learned_sampled": sampled.final_val_acc,
            **{k: v.final_val_acc for k, v in fixed.items()},
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
    ax.set_title("Final validation accuracy gained by the learned policy")
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
    parser.add_argument("--eval-seed", type=int, default=0)
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
        diffs = np.array([r["rows"][0]["vs_no_growth_mean"] for r in results])
        print(
            f"\nacross {len(results)} training seeds, learned − no growth: "
            f"{diffs.mean() * 100:+.2f} ± {diffs.std(ddof=1) / math.sqrt(diffs.size) * 100:.2f} pts "
            "(mean ± SE over seeds)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learning.json").write_text(json.dumps(results, indent=2, default=float))
    print(f"wrote {args.out / 'learning.json'}")
    if args.curve:
        draw_curve(results, args.out / "learning_curve.png")
        print(f"wrote {args.out / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
