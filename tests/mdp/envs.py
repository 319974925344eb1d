"""Small real envs for tests: synthetic images, a narrow CNN, short episodes."""

from __future__ import annotations

import torch

from esper.mdp.env import MorphogeneticVecEnv
from esper.mdp.env_config import EnvConfig
from esper.simic.buffer import RolloutBuffer
from esper.simic.normalizer import RunningObsNormalizer
from esper.simic.ppo_collector import PPOCollector
from esper.tamiyo.policy import PolicyConfig, PolicyNetwork
from esper.tolaria.data import SyntheticImageDataModule

HIDDEN = 32
GAMMA, LAMBDA = 0.99, 0.95


def small_data() -> SyntheticImageDataModule:
    return SyntheticImageDataModule(n_train=64, n_val=32, batch_size=16, val_batch_size=32)


def small_env(n_envs: int, episode_epochs: int = 4, **overrides: object) -> MorphogeneticVecEnv:
    config = EnvConfig(
        n_envs=n_envs,
        episode_epochs=episode_epochs,
        host_kwargs={"channels": [4, 8]},
        **overrides,  # type: ignore[arg-type]
    )
    return MorphogeneticVecEnv(config, small_data())


def collector(env: MorphogeneticVecEnv, seed: int = 0) -> PPOCollector:
    torch.manual_seed(seed)
    policy = PolicyNetwork(env.layout.dim, env.schema, PolicyConfig(hidden_size=HIDDEN))
    policy.to(env.device)
    buffer = RolloutBuffer(
        env.n_envs, env.decisions_per_episode, env.layout.dim, env.schema, (1, HIDDEN), env.device
    )
    return PPOCollector(
        env, policy, RunningObsNormalizer(env.layout.dim).to(env.device), buffer, GAMMA, LAMBDA
    )
