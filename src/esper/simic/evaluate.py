"""Does growth pay off? Run fresh hosts under four controllers and compare them.

The learned policy (each head's most likely choice, or sampled with ``sample=True``:
the stochastic policy PPO trained) is set against the heuristic controller, a random
legal controller and no growth (WAIT only). Every controller gets the same hosts at the
start (seeds never used in training), the same data order and the same parameter
budget. Episodes run side by side in groups as large as a training host's paired group
(else the run's ``n_envs``), so each host gets as much of every batch as in training
(``esper.simic.episodes`` runs them); this module loads the checkpoint and tabulates the
paired results.
"""

from __future__ import annotations

import csv
import importlib
import inspect
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from esper.callbacks.checkpoint import CheckpointError, EsperCheckpointIO
from esper.contracts.rollout import StepBatch
from esper.simic.advantages import group_size
from esper.simic.checkpoint_contents import (
    DATA_KEY,
    ENVS_PER_RANK_KEY,
    check_same_action_space,
    checkpoint_policy_spec,
)
from esper.simic.env import MorphogeneticVecEnv
from esper.simic.env_config import EnvConfig, action_schema
from esper.simic.episodes import baseline_controller, run_episodes
from esper.simic.module import PPOModule
from esper.simic.rollout import Controller
from esper.tolaria.data.base import HostDataModule

#: What ``esper evaluate`` compares by default.
CONTROLLERS: tuple[str, ...] = ("learned", "heuristic", "random", "no_growth")
#: Every controller it can run: the defaults and the scripted grower (``SCRIPTED_GROWTH``).
ALL_CONTROLLERS: tuple[str, ...] = (*CONTROLLERS, "scripted")
#: Columns of the table, CSV and JSON, in order.
COLUMNS: tuple[str, ...] = (
    "controller",
    "episodes",
    "final_val_acc_mean",
    "final_val_acc_std",
    "params_added_mean",
    "seeds_germinated_mean",
    "seeds_fossilized_mean",
    "seeds_pruned_mean",
    "return_mean",
    "vs_no_growth_mean",
    "vs_no_growth_se",
    "wall_s",
)
#: The controller every other one is paired against in the table.
REFERENCE = "no_growth"


@dataclass(frozen=True)
class ControllerResult:
    """One controller's figures over the evaluation episodes (means over episodes)."""

    controller: str
    episodes: int
    final_val_acc_mean: float
    final_val_acc_std: float
    params_added_mean: float
    seeds_germinated_mean: float
    seeds_fossilized_mean: float
    seeds_pruned_mean: float
    return_mean: float
    wall_s: float
    final_val_acc: tuple[float, ...]
    #: Final accuracy minus no growth's over the same episodes, and its standard error
    #: (NaN when no growth was not run, or for no growth itself).
    vs_no_growth_mean: float = math.nan
    vs_no_growth_se: float = math.nan


@dataclass
class Evaluation:
    results: list[ControllerResult]
    #: Per controller, the step batches of each group of episodes run side by side.
    steps: dict[str, list[list[StepBatch]]]
    slot_ids: tuple[str, ...]

    def table(self) -> str:
        header = (
            f"{'controller':<10} {'final val acc (mean ± std)':>26} "
            f"{'− no growth (mean ± SE)':>24} {'params':>7} {'germ':>5} {'foss':>5} "
            f"{'prune':>5} {'return':>8} {'wall s':>7}"
        )
        lines = [header, "-" * len(header)]
        for r in self.results:
            versus = (
                ""
                if math.isnan(r.vs_no_growth_mean)
                else f"{r.vs_no_growth_mean * 100:+.2f} ± {r.vs_no_growth_se * 100:.2f} pts"
            )
            lines.append(
                f"{r.controller:<10} {r.final_val_acc_mean:>17.4f} ± {r.final_val_acc_std:<6.4f} "
                f"{versus:>24} {r.params_added_mean:>7.0f} {r.seeds_germinated_mean:>5.2f} "
                f"{r.seeds_fossilized_mean:>5.2f} {r.seeds_pruned_mean:>5.2f} "
                f"{r.return_mean:>+8.4f} {r.wall_s:>7.1f}"
            )
        return "\n".join(lines)

    def rows(self) -> list[dict[str, Any]]:
        return [{k: asdict(r)[k] for k in COLUMNS} for r in self.results]

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

    def write(self, out_dir: Path) -> dict[str, Path]:
        """``evaluation.csv`` and ``evaluation.json`` (rows plus per-episode accuracies)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"csv": out_dir / "evaluation.csv", "json": out_dir / "evaluation.json"}
        with paths["csv"].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows())
        payload = {
            "rows": self.rows(),
            "final_val_acc": {r.controller: list(r.final_val_acc) for r in self.results},
        }
        paths["json"].write_text(json.dumps(payload, indent=2))
        return paths


def load_datamodule(checkpoint: dict[str, Any], path: Path) -> HostDataModule:
    """Rebuild the host data module a checkpoint was trained on."""
    spec = checkpoint.get(DATA_KEY)
    if spec is None:
        raise CheckpointError(
            f"checkpoint {path} does not name its data module (no {DATA_KEY!r}); it was "
            "written by an older esper: pass the data module to evaluate() yourself"
        )
    module_name, _, class_name = spec["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} was trained on data module {spec['class_path']}, which cannot "
            f"be imported here ({type(exc).__name__}: {exc}); install the package that "
            "provides it"
        ) from exc
    return cls(**spec["init_args"])


def load_module(path: Path) -> tuple[PPOModule, dict[str, Any]]:
    """A PPOModule with the checkpoint's hyperparameters, policy and normaliser."""
    checkpoint = EsperCheckpointIO().load_checkpoint(path)
    checkpoint_policy_spec(checkpoint, path)  # not PPOModule's: say so before building one
    accepted = inspect.signature(PPOModule.__init__).parameters
    # LightningCLI adds its own entries (e.g. "_instantiator") beside the module's arguments.
    hparams = {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if k in accepted}
    try:
        module = PPOModule(**hparams)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} holds settings this esper does not accept ({exc}); "
            "evaluate it with the esper version that wrote it"
        ) from exc
    module.on_load_checkpoint(checkpoint)
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"checkpoint {path} holds weights that do not fit its own policy spec "
            f"({str(exc).splitlines()[0]}); the file is damaged"
        ) from exc
    return module, checkpoint


def evaluate(
    ckpt: Path | str,
    episodes: int = 8,
    seed: int = 0,
    device: str = "cpu",
    datamodule: HostDataModule | None = None,
    controllers: tuple[str, ...] = CONTROLLERS,
    sample: bool = False,
    on_controller_done: Callable[[ControllerResult], None] | None = None,
) -> Evaluation:
    """Run ``episodes`` fresh episodes under each controller; see the module docstring.

    ``sample`` draws the learned policy's actions from its distribution (seeded by the
    episode group, so a repeat gives the same episodes) instead of taking each head's
    most likely choice; the other controllers are unaffected. ``on_controller_done`` is
    called with each controller's result as soon as its episodes are done (progress).
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be an int >= 1, got {episodes!r}")
    unknown = [c for c in controllers if c not in ALL_CONTROLLERS]
    if unknown:
        raise ValueError(f"unknown controllers {unknown}; choose from {list(ALL_CONTROLLERS)}")
    path = Path(ckpt)
    module, checkpoint = load_module(path)
    data = datamodule or load_datamodule(checkpoint, path)
    config = evaluation_config(module, _envs_per_rank(checkpoint, module, path))
    assert module.policy is not None and module.normalizer is not None
    check_same_action_space(module.policy.schema, action_schema(config, data), path)
    policy = module.policy.to(device).eval()
    normalizer = module.normalizer.to(device)

    results, all_steps = [], {}
    slot_ids = module.policy.schema.slot_ids
    for name in controllers:
        run = run_episodes(
            config,
            data,
            lambda env, name=name: _controller(name, policy, env),
            # Only the policy learned in normalised units; the others read raw features.
            normalizer if name == "learned" else None,
            episodes=episodes,
            seed=seed,
            gamma=module.ppo_config.gamma,
            gae_lambda=module.ppo_config.gae_lambda,
            device=device,
            deterministic=not (sample and name == "learned"),
            policy_threads=module.policy_config.cpu_threads,
        )
        acc = run.per_episode["final_val_acc"]
        results.append(
            ControllerResult(
                controller=name,
                episodes=episodes,
                final_val_acc_mean=float(acc.mean()),
                final_val_acc_std=float(acc.std(ddof=1)) if episodes > 1 else 0.0,
                params_added_mean=float(run.per_episode["params_added"].mean()),
                seeds_germinated_mean=float(run.per_episode["seeds_germinated"].mean()),
                seeds_fossilized_mean=float(run.per_episode["seeds_fossilized"].mean()),
                seeds_pruned_mean=float(run.per_episode["seeds_pruned"].mean()),
                return_mean=float(run.per_episode["episode_return"].mean()),
                wall_s=run.wall_s,
                final_val_acc=tuple(acc.tolist()),
            )
        )
        all_steps[name] = run.steps
        if on_controller_done is not None:
            on_controller_done(results[-1])
    return Evaluation(_paired_with_reference(results), all_steps, slot_ids)


def evaluation_config(module: PPOModule, envs_per_rank: int | None = None) -> EnvConfig:
    """The run's env config, with as many envs side by side as trained on one data share.

    A training host trained on 1/n of every batch, n being its paired group's size, or
    the envs on its rank when unpaired (``envs_per_rank``, which the checkpoint records:
    a DDP run splits ``model.n_envs`` over its ranks; None for a checkpoint from before
    it did, taken as one rank). Evaluation runs unpaired groups of that n, so each
    evaluated host trains on as much data as the policy's hosts did.
    """
    config = replace(module.env_config, devices=None)
    n = config.n_envs if envs_per_rank is None else envs_per_rank
    if module.ppo_config.paired_envs:
        n = group_size(n, module.ppo_config.pair_size)
    return replace(config, n_envs=n)


def _envs_per_rank(checkpoint: dict[str, Any], module: PPOModule, path: Path) -> int | None:
    """The envs each training rank ran, as the checkpoint records them (None: not recorded)."""
    value = checkpoint.get(ENVS_PER_RANK_KEY)
    n_envs = module.env_config.n_envs
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or n_envs % value:
        raise CheckpointError(
            f"checkpoint {path} records {ENVS_PER_RANK_KEY}={value!r}, which does not divide "
            f"its model.n_envs={n_envs} into ranks; the file is damaged"
        )
    return value


def _paired_with_reference(results: list[ControllerResult]) -> list[ControllerResult]:
    """``results`` with each one's paired difference to no growth filled in, if it ran."""
    reference = next((r for r in results if r.controller == REFERENCE), None)
    if reference is None:
        return results
    paired = []
    for r in results:
        if r is reference:
            paired.append(r)
            continue
        mean, se = standard_error_of_difference(r.final_val_acc, reference.final_val_acc)
        paired.append(replace(r, vs_no_growth_mean=mean, vs_no_growth_se=se))
    return paired


def _controller(
    name: str, policy: torch.nn.Module, env: MorphogeneticVecEnv
) -> tuple[Controller, tuple[int, int]]:
    if name == "learned":
        config = policy.config  # type: ignore[attr-defined]
        return policy, (config.lstm_layers, config.hidden_size)  # type: ignore[return-value]
    return baseline_controller(name, env)


def standard_error_of_difference(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float]:
    """Mean of ``a - b`` and its standard error, for paired episodes (same seeds)."""
    diff = np.asarray(a) - np.asarray(b)
    if diff.size < 2:
        return float(diff.mean()), math.nan
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))
