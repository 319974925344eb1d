"""Does growth pay off? Run fresh hosts under four controllers and compare them.

The learned policy (each head's most likely choice, or sampled with ``sample=True``:
the stochastic policy PPO trained) is set against the heuristic controller, a random
legal controller and no growth (WAIT only). Every controller gets the same hosts at the
start (seeds never used in training), the same data order and the same parameter
budget. Episodes run in groups of the training run's ``n_envs`` side by side, so each
host gets the same share of every batch as in training.
"""

from __future__ import annotations

import csv
import importlib
import inspect
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from esper.callbacks.checkpoint import CheckpointError, EsperCheckpointIO
from esper.contracts.rollout import StepBatch
from esper.simic.buffer import RolloutBuffer
from esper.simic.env import MorphogeneticVecEnv
from esper.simic.env_config import EnvConfig, action_schema
from esper.simic.module import DATA_KEY, PPOModule, check_same_action_space, checkpoint_policy_spec
from esper.simic.rollout import Controller, RolloutCollector
from esper.tamiyo.baselines import STATE_SHAPE, NoGrowthController, RandomLegalController
from esper.tamiyo.heuristic import SCRIPTED_GROWTH, HeuristicController
from esper.tolaria.data.base import HostDataModule

#: Evaluation seeds start here, far from the rollout indices training used as seeds.
EVAL_SEED_BASE = 1_000_000_007
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
    config = replace(module.env_config, devices=None)
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
            lambda env, name=name: _controller(name, policy, env, normalizer),
            normalizer,
            episodes=episodes,
            seed=seed,
            gamma=module.ppo_config.gamma,
            gae_lambda=module.ppo_config.gae_lambda,
            device=device,
            deterministic=not (sample and name == "learned"),
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


#: Per-episode figures :func:`run_episodes` keeps from each rollout summary.
EPISODE_FIELDS: tuple[str, ...] = (
    "final_val_acc",
    "params_added",
    "seeds_germinated",
    "seeds_fossilized",
    "seeds_pruned",
    "episode_return",
)


class RawObservations:
    """A normaliser that normalises nothing and learns nothing, for untrained controllers.

    The collector calls its normaliser on every observation and updates it after each
    rollout; :func:`run_episodes` saves and restores its (empty) state.
    """

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def update(self, *args: object, **kwargs: object) -> None:
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        return None


@dataclass
class Episodes:
    """One controller's evaluation episodes.

    Attributes:
        per_episode: each of :data:`EPISODE_FIELDS` as ``[episodes]`` floats.
        val_acc: ``[episodes, episode_epochs]`` host validation accuracy after each epoch.
        steps: the step batches of each group of episodes run side by side.
        wall_s: seconds spent in the rollouts.
    """

    per_episode: dict[str, np.ndarray]
    val_acc: np.ndarray
    steps: list[list[StepBatch]]
    wall_s: float


def run_episodes(
    config: EnvConfig,
    data: HostDataModule,
    make_controller: Callable[[MorphogeneticVecEnv], tuple[Controller, tuple[int, int]]],
    normalizer: Any,
    episodes: int,
    seed: int,
    gamma: float,
    gae_lambda: float,
    device: str = "cpu",
    deterministic: bool = True,
) -> Episodes:
    """Run ``episodes`` fresh episodes under one controller, ``config.n_envs`` at a time.

    Group ``g`` starts from the same hosts, data order and seed initialisations for every
    controller (all are keyed by ``EVAL_SEED_BASE + seed + g``), so episodes of two
    controllers are paired. ``normalizer`` is used, never updated; None hands the
    controller raw observations (for controllers that need no trained normaliser).
    """
    if normalizer is None:
        normalizer = RawObservations()
    group = config.n_envs  # as many envs side by side as in training: same data share each
    parts: dict[str, list[np.ndarray]] = {}
    curves: list[np.ndarray] = []
    steps_by_group: list[list[StepBatch]] = []
    wall = 0.0
    for g in range(math.ceil(episodes / group)):
        seed_g = EVAL_SEED_BASE + seed + g
        torch.manual_seed(seed_g)  # the same initial hosts for every controller
        env = MorphogeneticVecEnv(config, data, device)
        env.reseed_data(seed_g)
        controller, state_shape = make_controller(env)
        buffer = RolloutBuffer(
            group, env.decisions_per_episode, env.layout.dim, env.schema, state_shape, device
        )
        collector = RolloutCollector(env, controller, normalizer, buffer, gamma, gae_lambda)
        collector.seed_offset = seed_g  # seeds planted from generators training never used
        collector.seed_stride = 0
        steps: list[StepBatch] = []
        normalizer_state = {k: v.clone() for k, v in normalizer.state_dict().items()}
        start = time.perf_counter()
        # A sampling controller draws from the global generator, seeded above after the
        # hosts were built: the same draws on a repeat, and the same hosts as the others.
        _, summary = collector.collect(0, on_step=steps.append, deterministic=deterministic)
        wall += time.perf_counter() - start
        normalizer.load_state_dict(normalizer_state)  # evaluation must not learn
        keep = min(group, episodes - g * group)
        for field_name in EPISODE_FIELDS:
            values = np.asarray(getattr(summary, field_name), dtype=float)
            parts.setdefault(field_name, []).append(values[:keep])
        curve = np.stack([s.val_acc for s in steps] + [steps[-1].next_val_acc], axis=1)
        curves.append(curve[:keep])
        steps_by_group.append(steps)
    return Episodes(
        per_episode={k: np.concatenate(v) for k, v in parts.items()},
        val_acc=np.concatenate(curves),
        steps=steps_by_group,
        wall_s=wall,
    )


def _controller(
    name: str, policy: torch.nn.Module, env: MorphogeneticVecEnv, normalizer: Any
) -> tuple[Controller, tuple[int, int]]:
    if name == "learned":
        config = policy.config  # type: ignore[attr-defined]
        return policy, (config.lstm_layers, config.hidden_size)  # type: ignore[return-value]
    return baseline_controller(name, env, normalizer)


def baseline_controller(
    name: str, env: MorphogeneticVecEnv, normalizer: Any
) -> tuple[Controller, tuple[int, int]]:
    """A controller that needs no training (every name of :data:`ALL_CONTROLLERS` but
    ``learned``), on ``env``'s device, with the recurrent-state shape the buffer stores."""
    builders: dict[str, Callable[[], Any]] = {
        "heuristic": lambda: HeuristicController(env.layout, env.schema, normalizer=normalizer),
        "scripted": lambda: HeuristicController(
            env.layout, env.schema, SCRIPTED_GROWTH, normalizer=normalizer
        ),
        "random": RandomLegalController,
        "no_growth": NoGrowthController,
    }
    return builders[name]().to(env.device), STATE_SHAPE


def standard_error_of_difference(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float]:
    """Mean of ``a - b`` and its standard error, for paired episodes (same seeds)."""
    diff = np.asarray(a) - np.asarray(b)
    if diff.size < 2:
        return float(diff.mean()), math.nan
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))
