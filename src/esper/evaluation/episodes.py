"""Fresh, paired episodes under one controller: the runner behind ``esper evaluate``.

Every comparison of controllers (``esper.evaluation.evaluate``, ``benchmarks/growth.py``) needs
the same thing: episodes that start from the same hosts, data order and seed
initialisations whatever the controller, so that differences between controllers are
paired per episode. :func:`run_episodes` builds them from evaluation seeds training never
used; :func:`baseline_controller` builds the controllers that need no training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from esper.contracts.evaluation import seed_range
from esper.contracts.rollout import StepBatch
from esper.kasmina.architecture import Architecture, final_architecture, final_param_count
from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig
from esper.mdp.rollout import Controller, ObservationTransform, RolloutCollector
from esper.mdp.transitions import Cursors
from esper.tamiyo.baselines import NoGrowthController, RandomLegalController
from esper.tamiyo.heuristic import SCRIPTED_GROWTH, HeuristicController, preferring_what_fits
from esper.tamiyo.periodic import periodic_controller
from esper.tolaria.compute import PROBE_SAMPLES, TrainingCompute
from esper.tolaria.counterfactual import validate_with_counterfactuals
from esper.tolaria.data.base import HostDataModule

#: Evaluation seeds start here, far from the rollout indices training used as seeds.
EVAL_SEED_BASE = 1_000_000_007
#: Episode groups one evaluation seed may hold: group ``g`` of seed ``s`` is keyed
#: ``EVAL_SEED_BASE + s * GROUPS_PER_SEED + g``, so no two seeds share an episode.
GROUPS_PER_SEED = 2**20
#: Per-episode figures :func:`run_episodes` keeps from each rollout summary.
EPISODE_FIELDS: tuple[str, ...] = (
    "final_val_acc",
    "params_added",
    "seeds_germinated",
    "seeds_fossilized",
    "seeds_pruned",
    "episode_return",
)
#: Per-episode figures measured on the hosts at the episode's end, beside those.
END_FIELDS: tuple[str, ...] = ("final_test_acc", "params_final", "train_flops")


def group_key(seed: int, group: int) -> int:
    """The key of episode group ``group`` of evaluation seed ``seed``: its hosts, data
    order and seed initialisations. Distinct for every (seed, group) pair."""
    seed_range(seed)
    if not 0 <= group < GROUPS_PER_SEED:
        raise ValueError(f"episode group {group} is outside 0..{GROUPS_PER_SEED - 1}")
    return EVAL_SEED_BASE + seed * GROUPS_PER_SEED + group


@dataclass
class Episodes:
    """One controller's evaluation episodes.

    Attributes:
        per_episode: each of :data:`EPISODE_FIELDS` and :data:`END_FIELDS` as
            ``[episodes]`` floats: ``final_test_acc`` is the final host's accuracy on the
            test split (read once, after the episode), ``params_final`` its parameter
            count (``esper.kasmina.architecture.final_param_count``), ``train_flops`` the
            forward and backward FLOPs its training took (``esper.tolaria.compute``).
        val_acc: ``[episodes, episode_epochs]`` host validation accuracy after each epoch.
        steps: the step batches of each group of episodes run side by side.
        wall_s: seconds spent in the rollouts.
        groups: ``[episodes]`` the episode group each episode ran in: episodes of a group
            share their loader's data order, so error bars treat a group as one unit.
        architectures: each episode's final architecture (the seeds its host ends with).
    """

    per_episode: dict[str, np.ndarray]
    val_acc: np.ndarray
    steps: list[list[StepBatch]]
    wall_s: float
    groups: np.ndarray
    architectures: list[Architecture]


def run_episodes(
    config: EnvConfig,
    data: HostDataModule,
    make_controller: Callable[[MorphogeneticVecEnv], Controller],
    normalize: ObservationTransform | None,
    episodes: int,
    seed: int,
    device: str = "cpu",
    deterministic: bool = True,
    policy_threads: int | None = None,
    architectures: Sequence[Architecture] | None = None,
) -> Episodes:
    """Run ``episodes`` fresh episodes under one controller, ``config.n_envs`` at a time.

    Group ``g`` starts from the same hosts, data order and seed initialisations for every
    controller (all are keyed by :func:`group_key` of ``seed`` and ``g``), so episodes of
    two controllers are paired. ``normalize`` (the learned policy's normaliser) makes
    the observations the controller sees; nothing here updates it. None hands the
    controller the raw observations, as every untrained one expects. No transition is
    kept and nothing is learned: the envs' step batches and summaries are the result. ``policy_threads``: intra-op threads for the controller's act and value on
    the CPU, as in training (``PolicyConfig.cpu_threads``; None: torch's count).
    ``architectures`` (one per episode) are built into each episode's host before its
    first epoch (the ``static_final`` control).

    After each group's episodes the final hosts are scored on the test split, which
    nothing before that reads.
    """
    seed_range(seed)
    if architectures is not None and len(architectures) != episodes:
        raise ValueError(f"{len(architectures)} architectures for {episodes} episodes")
    group = config.n_envs  # as many envs side by side as in training: same data share each
    parts: dict[str, list[np.ndarray]] = {}
    curves: list[np.ndarray] = []
    steps_by_group: list[list[StepBatch]] = []
    finals: list[Architecture] = []
    wall = 0.0
    compute = TrainingCompute(data.train_dataset[:PROBE_SAMPLES])  # kept across groups
    for g in range(math.ceil(episodes / group)):
        seed_g = group_key(seed, g)
        keep = min(group, episodes - g * group)
        torch.manual_seed(seed_g)  # the same initial hosts for every controller
        env = MorphogeneticVecEnv(config, data, device)
        env.reseed_data(seed_g)
        env.compute = compute
        if architectures is not None:
            mine = list(architectures[g * group : g * group + keep])
            env.initial_architectures = mine + [None] * (group - keep)
        controller = make_controller(env)
        store = Cursors(group, env.decisions_per_episode)
        collector = RolloutCollector(
            env, controller, store, normalize, policy_threads=policy_threads
        )
        collector.seed_offset = seed_g  # seeds planted from generators training never used
        collector.seed_stride = 0
        steps: list[StepBatch] = []
        start = time.perf_counter()
        # A sampling controller draws from the global generator, seeded above after the
        # hosts were built: the same draws on a repeat, and the same hosts as the others.
        summary = collector.collect(0, on_step=steps.append, deterministic=deterministic).summary
        wall += time.perf_counter() - start
        end = _measure_end(env, data, device)
        for field_name in EPISODE_FIELDS:
            values = np.asarray(getattr(summary, field_name), dtype=float)
            parts.setdefault(field_name, []).append(values[:keep])
        for field_name, values in end.items():
            parts.setdefault(field_name, []).append(values[:keep])
        parts.setdefault("group", []).append(np.full(keep, g))
        finals.extend(final_architecture(host.model) for host in env.hosts[:keep])
        curve = np.stack([s.val_acc for s in steps] + [steps[-1].next_val_acc], axis=1)
        curves.append(curve[:keep])
        steps_by_group.append(steps)
    groups = np.concatenate(parts.pop("group")).astype(np.int64)
    return Episodes(
        per_episode={k: np.concatenate(v) for k, v in parts.items()},
        val_acc=np.concatenate(curves),
        steps=steps_by_group,
        wall_s=wall,
        groups=groups,
        architectures=finals,
    )


def _measure_end(
    env: MorphogeneticVecEnv, data: HostDataModule, device: str
) -> dict[str, np.ndarray]:
    """:data:`END_FIELDS` of every env's final host: the episode is over, so the test
    split is read here (one pass, one read) and nowhere in the rollout."""
    _, test_acc, _ = validate_with_counterfactuals(
        env.hosts, data.host_test_dataloader(), torch.device(device)
    )
    return {
        "final_test_acc": np.asarray(test_acc.tolist(), dtype=float),
        "params_final": np.array([final_param_count(h.model) for h in env.hosts], dtype=float),
        "train_flops": env.train_flops.astype(float),
    }


def baseline_controller(name: str, env: MorphogeneticVecEnv) -> Controller:
    """A controller that needs no training (every name of
    ``esper.contracts.evaluation.GROWERS`` but ``learned``, and ``no_growth``), on
    ``env``'s device.

    Run it with ``run_episodes(..., normalize=None)``: the heuristic's thresholds are in
    the units of the raw features, and the others ignore the observation.
    """
    builders: dict[str, Callable[[], torch.nn.Module]] = {
        "heuristic": lambda: HeuristicController(env.layout, env.schema),
        "periodic": lambda: periodic_controller(
            env.layout, env.schema, env.config.episode_epochs, env.config.lifecycle
        ),
        "scripted": lambda: HeuristicController(
            env.layout, env.schema, preferring_what_fits(SCRIPTED_GROWTH, env.schema)
        ),
        "random": RandomLegalController,
        "no_growth": NoGrowthController,
    }
    return builders[name]().to(env.device)
