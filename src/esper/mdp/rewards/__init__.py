"""Reward families and their registry (entry-point group ``esper.rewards``).

A reward plugin is a callable ``(RewardInputs, RewardConfig) -> dict[str, np.ndarray]``
(see :class:`RewardFn`) returning named ``[E]`` float32 components; the run sums them
with :func:`total` and logs each one.
"""

from __future__ import annotations

from esper.mdp.rewards.base import RewardConfig, RewardFn, RewardInputs, total
from esper.mdp.rewards.shaped import shaped_reward
from esper.mdp.rewards.sparse import sparse_reward
from esper.plugins import Registry


def _as_reward_fn(name: str, obj: object) -> RewardFn:
    if not callable(obj):
        raise TypeError(
            f"reward {name!r} must be callable as fn(inputs: RewardInputs, config: RewardConfig) "
            f"-> dict[str, np.ndarray], got {obj!r} of type {type(obj).__name__}"
        )
    return obj  # type: ignore[return-value]


REWARDS: Registry[RewardFn] = Registry("esper.rewards", "reward", validate=_as_reward_fn)
REWARDS.register("shaped", shaped_reward)
REWARDS.register("sparse", sparse_reward)

__all__ = [
    "REWARDS",
    "RewardConfig",
    "RewardFn",
    "RewardInputs",
    "shaped_reward",
    "sparse_reward",
    "total",
]
