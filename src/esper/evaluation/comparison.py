"""Growers set against the controls a researcher asks for, on paired episodes.

Every controller runs the same episodes (``esper.evaluation.episodes.run_episodes``: same
initial hosts, data order and seed initialisations per episode group). The rows:

* growers: ``learned`` (a checkpoint's policy, supplied by ``esper.evaluation.evaluate``),
  ``periodic`` (plants at evenly spaced epochs, keeps what the gates allow),
  ``heuristic``, ``scripted`` and ``random``;
* ``no_growth``: the host left alone;
* ``static_final``: each episode of the grower (``grower``, ``learned`` by default)
  ends with some architecture; the same architecture is built at epoch 0 of the same
  episode and trained the whole episode with the same recipe: the network without the
  growing;
* ``static_equal``: the plain host family widened to the grower's mean final parameter
  count (within ``esper.kasmina.sizing``'s tolerance), trained alone.

Each row reports test accuracy (the split nothing else reads) with a 95% interval,
validation accuracy beside it, the final network's parameters and the training FLOPs
spent, and paired differences to no growth and to the grower. Error bars treat an
episode group as one unit (``esper.report.statistics``).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from esper.contracts.evaluation import (
    ALL_CONTROLLERS,
    DEFAULT_GROWER,
    GROWERS,
    NO_GROWTH,
    STATIC_CONTROLS,
    seed_range,
)
from esper.contracts.rollout import StepBatch
from esper.evaluation.episodes import Episodes, baseline_controller, run_episodes
from esper.kasmina import HOSTS
from esper.kasmina.sizing import equal_size_host_kwargs
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig, build_host
from esper.mdp.rollout import Controller, ObservationTransform
from esper.report.statistics import Estimate, clustered_mean, paired_difference
from esper.tolaria.data.base import HostDataModule


@dataclass(frozen=True)
class ControllerSpec:
    """How to run one controller's episodes.

    Attributes:
        make: builds the controller for an env.
        normalize: the observation normaliser it learned with (only applied); None hands
            it the raw observations, as every untrained controller expects.
        deterministic: act on each head's most likely choice instead of sampling.
        policy_threads: intra-op threads for its act on the CPU (None: torch's).
    """

    make: Callable[[MorphogeneticVecEnv], Controller]
    normalize: ObservationTransform | None = None
    deterministic: bool = True
    policy_threads: int | None = None


@dataclass(frozen=True)
class ControllerResult:
    """One controller's figures over the evaluation episodes.

    ``test`` is the mean final test accuracy with its clustered error bar; ``versus``
    maps a reference controller's name to the paired difference of test accuracy
    (this controller minus the reference) over the same episodes. Per-episode arrays
    are in episode order, the same order for every controller.
    """

    controller: str
    episodes: int
    test: Estimate
    final_val_acc_mean: float
    params_final_mean: float
    train_flops_mean: float
    params_added_mean: float
    seeds_germinated_mean: float
    seeds_fossilized_mean: float
    seeds_pruned_mean: float
    return_mean: float
    wall_s: float
    final_test_acc: tuple[float, ...]
    final_val_acc: tuple[float, ...]
    params_final: tuple[float, ...]
    train_flops: tuple[float, ...]
    versus: dict[str, Estimate] = field(default_factory=dict)

    @property
    def final_test_acc_mean(self) -> float:
        return self.test.mean


@dataclass
class Evaluation:
    """Every controller's result, in the order asked for, and how they were run."""

    results: list[ControllerResult]
    #: Per controller, the step batches of each group of episodes run side by side.
    steps: dict[str, list[list[StepBatch]]]
    slot_ids: tuple[str, ...]
    seed: int
    grower: str
    #: ``[episodes]`` the episode group of each episode: the unit of every error bar.
    groups: tuple[int, ...]
    #: The host arguments ``static_equal`` ran with, when it ran.
    static_equal_host_kwargs: dict[str, Any] | None = None

    @property
    def references(self) -> tuple[str, ...]:
        """The controllers every row is paired against: no growth, then the grower."""
        return tuple(dict.fromkeys((NO_GROWTH, self.grower)))

    def columns(self) -> tuple[str, ...]:
        """Columns of the CSV and of the JSON's rows, in order."""
        versus = [
            f"vs_{ref}_{part}" for ref in self.references for part in ("mean", "se", "low", "high")
        ]
        return (
            "controller",
            "episodes",
            "final_test_acc_mean",
            "final_test_acc_se",
            "final_test_acc_low",
            "final_test_acc_high",
            "final_val_acc_mean",
            "params_final_mean",
            "train_flops_mean",
            *versus,
            "params_added_mean",
            "seeds_germinated_mean",
            "seeds_fossilized_mean",
            "seeds_pruned_mean",
            "return_mean",
            "wall_s",
        )

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.results:
            row: dict[str, Any] = {
                "controller": r.controller,
                "episodes": r.episodes,
                "final_test_acc_mean": r.test.mean,
                "final_test_acc_se": r.test.se,
                "final_test_acc_low": r.test.low,
                "final_test_acc_high": r.test.high,
                "final_val_acc_mean": r.final_val_acc_mean,
                "params_final_mean": r.params_final_mean,
                "train_flops_mean": r.train_flops_mean,
                "params_added_mean": r.params_added_mean,
                "seeds_germinated_mean": r.seeds_germinated_mean,
                "seeds_fossilized_mean": r.seeds_fossilized_mean,
                "seeds_pruned_mean": r.seeds_pruned_mean,
                "return_mean": r.return_mean,
                "wall_s": r.wall_s,
            }
            for ref in self.references:
                est = r.versus.get(ref)
                for part in ("mean", "se", "low", "high"):
                    row[f"vs_{ref}_{part}"] = math.nan if est is None else getattr(est, part)
            rows.append({k: row[k] for k in self.columns()})
        return rows

    def table(self) -> str:
        """The printed table: test accuracy first, validation beside it, the paired
        differences in points, parameters and training compute."""
        refs = self.references
        names = {NO_GROWTH: "no growth"}
        header = (
            f"{'controller':<13} {'test acc [95% CI]':>26} {'val acc':>8} "
            + " ".join(f"{'− ' + names.get(ref, ref) + ' (mean ± SE)':>25}" for ref in refs)
            + f" {'params':>7} {'train GFLOP':>11} {'foss':>5} {'wall s':>7}"
        )
        lines = [header, "-" * len(header)]
        for r in self.results:
            diffs = []
            for ref in refs:
                est = r.versus.get(ref)
                diffs.append(
                    "" if est is None else f"{est.mean * 100:+.2f} ± {_spread(est.se * 100)} pts"
                )
            interval = (
                f"[{r.test.low:.4f}, {r.test.high:.4f}]"
                if math.isfinite(r.test.low) and math.isfinite(r.test.high)
                else "[n/a: one group]"
            )
            lines.append(
                f"{r.controller:<13} {f'{r.test.mean:.4f} {interval}':>26} "
                f"{r.final_val_acc_mean:>8.4f} "
                + " ".join(f"{d:>25}" for d in diffs)
                + f" {r.params_final_mean:>7.0f} {r.train_flops_mean / 1e9:>11.3f} "
                f"{r.seeds_fossilized_mean:>5.2f} {r.wall_s:>7.1f}"
            )
        return "\n".join(lines)

    def write(self, out_dir: Path) -> dict[str, Path]:
        """``evaluation.csv`` (the rows) and ``evaluation.json`` (the rows, how the
        episodes were run, and every per-episode figure keyed by controller)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"csv": out_dir / "evaluation.csv", "json": out_dir / "evaluation.json"}
        rows = self.rows()
        with paths["csv"].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns())
            writer.writeheader()
            writer.writerows(rows)
        per_episode = ("final_test_acc", "final_val_acc", "params_final", "train_flops")
        payload: dict[str, Any] = {
            "seed": self.seed,
            "seed_range": seed_range(self.seed),
            "grower": self.grower,
            "episode_group": list(self.groups),
            "static_equal_host_kwargs": self.static_equal_host_kwargs,
            "rows": rows,
            **{
                name: {r.controller: list(getattr(r, name)) for r in self.results}
                for name in per_episode
            },
        }
        paths["json"].write_text(json.dumps(_json_safe(payload), indent=2))
        return paths

    def write_timelines(self, out_dir: Path) -> list[Path]:
        """One lifecycle timeline PNG per controller and episode."""
        from esper.report.timeline import render_timeline

        written = []
        for name, groups in self.steps.items():
            episode = 0
            episodes = next(r.episodes for r in self.results if r.controller == name)
            for steps in groups:
                for env in range(steps[0].n_envs if steps else 0):
                    if episode >= episodes:
                        break
                    path = out_dir / f"{name}_episode{episode}.png"
                    label = f"{name}, episode {episode}"
                    render_timeline(steps, env, self.slot_ids, path=path, label=label)
                    written.append(path)
                    episode += 1
        return written


def check_controllers(controllers: Sequence[str], grower: str) -> None:
    """Refuse unknown or repeated names, and static controls without their grower."""
    unknown = [c for c in controllers if c not in ALL_CONTROLLERS]
    if unknown:
        raise ValueError(f"unknown controllers {unknown}; choose from {list(ALL_CONTROLLERS)}")
    repeated = sorted({c for c in controllers if list(controllers).count(c) > 1})
    if repeated:
        raise ValueError(f"controllers {repeated} are listed more than once; list each once")
    if not controllers:
        raise ValueError(f"no controllers to run; choose from {list(ALL_CONTROLLERS)}")
    if grower not in GROWERS:
        raise ValueError(f"the grower the static controls copy must be one of {list(GROWERS)}")
    statics = [c for c in controllers if c in STATIC_CONTROLS]
    if statics and grower not in controllers:
        raise ValueError(
            f"{', '.join(statics)} copy the final networks of the grower {grower!r}: add it "
            f"to the controllers, or name another grower that runs"
        )


def compare(
    config: EnvConfig,
    data: HostDataModule,
    controllers: Sequence[str],
    episodes: int,
    seed: int,
    device: str = "cpu",
    specs: Mapping[str, ControllerSpec] | None = None,
    grower: str = DEFAULT_GROWER,
    on_controller_done: Callable[[ControllerResult], None] | None = None,
) -> Evaluation:
    """Run ``episodes`` paired episodes under each of ``controllers`` and compare them.

    ``specs`` supplies controllers that need more than their name (``learned``: a
    policy and its normaliser); every other grower and ``no_growth`` is built by
    :func:`esper.evaluation.episodes.baseline_controller`. The grower runs first, since the
    static controls are built from its episodes; rows come back in the order asked for.
    ``on_controller_done`` is called with each result as soon as its episodes are done.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be an int >= 1, got {episodes!r}")
    check_controllers(controllers, grower)
    seed_range(seed)
    specs = dict(specs or {})
    if "learned" in controllers and "learned" not in specs:
        raise ValueError("the learned controller needs a policy: evaluate a checkpoint")
    order = sorted(controllers, key=lambda c: (c != grower, c in STATIC_CONTROLS))
    runs: dict[str, Episodes] = {}
    static_equal_kwargs: dict[str, Any] | None = None

    def run(run_config: EnvConfig, spec: ControllerSpec, **extra: Any) -> Episodes:
        return run_episodes(
            run_config,
            data,
            spec.make,
            spec.normalize,
            episodes=episodes,
            seed=seed,
            device=device,
            deterministic=spec.deterministic,
            policy_threads=spec.policy_threads,
            **extra,
        )

    alone = ControllerSpec(lambda env: baseline_controller(NO_GROWTH, env))
    results: dict[str, ControllerResult] = {}
    for name in order:
        if name == "static_final":
            episodes_run = run(config, alone, architectures=runs[grower].architectures)
        elif name == "static_equal":
            target = float(runs[grower].per_episode["params_final"].mean())
            static_equal_kwargs = equal_size_config(config, data, target)
            episodes_run = run(replace(config, host_kwargs=static_equal_kwargs), alone)
        else:
            spec = specs.get(name) or ControllerSpec(
                lambda env, name=name: baseline_controller(name, env)
            )
            episodes_run = run(config, spec)
        runs[name] = episodes_run
        results[name] = _result(name, episodes_run, episodes)
        if on_controller_done is not None:
            on_controller_done(results[name])
    groups = next(iter(runs.values())).groups
    ordered = [_paired(results[name], results, groups, grower) for name in controllers]
    return Evaluation(
        results=ordered,
        steps={name: runs[name].steps for name in controllers},
        slot_ids=build_host(config, data).slot_ids,
        seed=seed,
        grower=grower,
        groups=tuple(int(g) for g in groups),
        static_equal_host_kwargs=static_equal_kwargs,
    )


def equal_size_config(config: EnvConfig, data: HostDataModule, target: float) -> dict[str, Any]:
    """Host arguments of ``config``'s host family widened to ``target`` parameters."""
    kwargs, _ = equal_size_host_kwargs(
        HOSTS.get(config.host), dict(config.host_kwargs), data.input_shape, data.n_classes, target
    )
    return kwargs


def _result(name: str, run: Episodes, episodes: int) -> ControllerResult:
    per = run.per_episode
    test = per["final_test_acc"]
    return ControllerResult(
        controller=name,
        episodes=episodes,
        test=clustered_mean(test, run.groups),
        final_val_acc_mean=float(per["final_val_acc"].mean()),
        params_final_mean=float(per["params_final"].mean()),
        train_flops_mean=float(per["train_flops"].mean()),
        params_added_mean=float(per["params_added"].mean()),
        seeds_germinated_mean=float(per["seeds_germinated"].mean()),
        seeds_fossilized_mean=float(per["seeds_fossilized"].mean()),
        seeds_pruned_mean=float(per["seeds_pruned"].mean()),
        return_mean=float(per["episode_return"].mean()),
        wall_s=run.wall_s,
        final_test_acc=tuple(float(v) for v in test),
        final_val_acc=tuple(float(v) for v in per["final_val_acc"]),
        params_final=tuple(float(v) for v in per["params_final"]),
        train_flops=tuple(float(v) for v in per["train_flops"]),
    )


def _paired(
    result: ControllerResult,
    results: Mapping[str, ControllerResult],
    groups: np.ndarray,
    grower: str,
) -> ControllerResult:
    """``result`` with its paired test-accuracy difference to no growth and the grower."""
    versus = {
        ref: paired_difference(result.final_test_acc, results[ref].final_test_acc, groups)
        for ref in (NO_GROWTH, grower)
        if ref in results and ref != result.controller
    }
    return replace(result, versus=versus)


def _spread(points: float) -> str:
    """A standard error in points, or "n/a" where it is undefined (one episode group)."""
    return f"{points:.2f}" if math.isfinite(points) else "n/a"


def _json_safe(value: Any) -> Any:
    """NaN as null: JSON has no NaN, and a reader in another language would choke on it."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
