"""Schemas, random action masks and a small policy shared by the tamiyo and simic tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from esper.contracts import ActionSchema, LifecycleOp
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import PolicyConfig, PolicyNetwork

SCHEMA = ActionSchema(slot_ids=("s0", "s1", "s2"), blueprint_names=("b0", "b1", "b2", "b3"))
OBS_DIM = 6
#: Small enough to keep the tests fast, large enough to be a real LSTM.
SMALL = PolicyConfig(hidden_size=32)


def make_policy(seed: int = 0, config: PolicyConfig = SMALL) -> PolicyNetwork:
    torch.manual_seed(seed)
    return PolicyNetwork(OBS_DIM, SCHEMA, config)


def random_masks(
    batch_shape: Sequence[int],
    generator: torch.Generator,
    p_legal: float = 0.5,
    schema: ActionSchema = SCHEMA,
) -> ActionMasks:
    """Random masks that are consistent the way the real builder's are.

    WAIT is always legal and uses no slot; any other op is legal only where it has a
    legal slot, and GERMINATE only on slots where some blueprint fits. At least one
    blend mode is legal.
    """
    n_ops, n_slots, n_blueprints, n_blends = (h.size for h in schema.heads)
    batch = tuple(batch_shape)

    def draw(*shape: int) -> torch.Tensor:
        return torch.rand((*batch, *shape), generator=generator) < p_legal

    blueprint = draw(n_slots, n_blueprints)
    blend = draw(n_blends)
    first_blend = torch.zeros_like(blend)
    first_blend[..., 0] = True
    blend = blend | (first_blend & ~blend.any(-1, keepdim=True))
    slot = draw(n_ops, n_slots)
    slot[..., LifecycleOp.WAIT, :] = False
    slot[..., LifecycleOp.GERMINATE, :] &= blueprint.any(-1)
    op = slot.any(-1)
    op[..., LifecycleOp.WAIT] = True
    return ActionMasks(op=op, slot=slot, blueprint=blueprint, blend=blend)
