"""How PPO's learning rate and entropy coefficient move over a run.

Functions of the update index alone, so a resumed run continues the same schedule.
"""

from __future__ import annotations

from esper.simic.ppo import PPOConfig


def learning_rate_at(config: PPOConfig, update: int, total: int) -> float:
    """Update ``update`` of ``total``: ``lr * (1 - update / total)`` when ``anneal_lr``.

    The last update still learns (its rate is ``lr / total``), as in CleanRL.
    """
    if not config.anneal_lr:
        return config.lr
    return config.lr * (1.0 - min(update / max(total, 1), 1.0))


def entropy_coef_at(start: float, final: float | None, update: int, total: int) -> float:
    """``start`` moved linearly to ``final`` by the last of ``total`` updates; ``final``
    None keeps ``start`` throughout."""
    if final is None:
        return start
    progress = min(update / max(total - 1, 1), 1.0)
    return start + (final - start) * progress
