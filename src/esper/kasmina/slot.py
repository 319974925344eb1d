"""A slot in a host where one seed can grow, and the forward rule that blends it in.

``forward(h) = h + alpha * seed(h_in)`` where ``h_in`` is ``h`` detached until the seed is
fossilized: the seed's path never sends gradients back into the host's earlier layers.

While TRAINING, alpha is 0: the slot passes ``h`` through, so the host trains exactly as
it would alone. The seed learns in a separate pass (``esper.kasmina.incubation``) in
which the slot is ``incubating`` and adds the seed at full strength against a frozen
host, so it leaves TRAINING as a fitted residual.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from esper.contracts import BlendMode, SeedStage
from esper.kasmina.blueprints import BLUEPRINTS, Blueprint, SlotShape
from esper.kasmina.lifecycle import GateResult, GateSignals, LifecycleConfig, SeedLifecycle

#: A GATED seed's per-channel gate starts at sigmoid(GATE_INIT_LOGIT) ~ 0.95: almost open,
#: so blending proceeds as scheduled unless the seed learns to shut channels.
GATE_INIT_LOGIT = 3.0


class ChannelGate(nn.Module):
    """A learned per-channel gate in (0, 1) multiplied onto a seed's output (BlendMode.GATED)."""

    def __init__(self, shape: SlotShape) -> None:
        super().__init__()
        self.channel_dim = 1 if shape.kind == "cnn" else -1
        self.logit = nn.Parameter(torch.full((shape.channels,), GATE_INIT_LOGIT))

    def forward(self, delta: Tensor) -> Tensor:
        view = [1] * delta.dim()
        view[self.channel_dim] = -1
        return delta * torch.sigmoid(self.logit).view(view)


class SeedSlot(nn.Module):
    """Holds at most one seed, its lifecycle (stage, epochs in stage, blend schedule) and alpha."""

    def __init__(self, slot_id: str, shape: SlotShape, lifecycle: LifecycleConfig | None = None):
        super().__init__()
        self.slot_id = slot_id
        self.shape = shape
        self.lifecycle = SeedLifecycle(lifecycle)
        self.seed: nn.Module | None = None
        self.gate: ChannelGate | None = None
        # Moves with .to()/.cuda() so a seed planted later is built on the host's device.
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)
        # Alpha as a device scalar, refreshed by every lifecycle op: forward multiplies by a
        # tensor, so a compiled forward does not recompile each time the ramp moves.
        self.register_buffer("_alpha_t", torch.zeros(()), persistent=False)
        # Per-replica alpha multipliers for the fused counterfactual pass; see `counterfactual`.
        self._cf_scale: Tensor | None = None
        #: Set during the incubation pass: a TRAINING seed then adds its output at alpha 1.
        self.incubating = False

    # ------------------------------------------------------------------ queries
    @property
    def stage(self) -> SeedStage:
        return self.lifecycle.stage

    @property
    def alpha(self) -> float:
        return self.lifecycle.alpha

    @property
    def has_seed(self) -> bool:
        return self.seed is not None

    @property
    def blends_output(self) -> bool:
        """True when the seed's output changes the slot's output value (alpha may be > 0)."""
        return self.seed is not None and self.stage in (
            SeedStage.BLENDING,
            SeedStage.HOLDING,
            SeedStage.FOSSILIZED,
        )

    def seed_parameters(self) -> Iterator[nn.Parameter]:
        for module in (self.seed, self.gate):
            if module is not None:
                yield from module.parameters()

    def seed_param_count(self) -> int:
        return sum(p.numel() for p in self.seed_parameters())

    # ------------------------------------------------------------- lifecycle ops
    def germinate(self, blueprint: str | Blueprint, blend_mode: BlendMode) -> nn.Module:
        """Plant a seed built from ``blueprint``; its output starts at zero."""
        bp = BLUEPRINTS.get(blueprint) if isinstance(blueprint, str) else blueprint
        module = bp.instantiate(self.shape)  # raises BlueprintFitError with the reason
        self.lifecycle.germinate(bp.name, blend_mode)
        device = self._device_anchor.device
        self.seed = module.to(device)
        if BlendMode(blend_mode) is BlendMode.GATED:
            self.gate = ChannelGate(self.shape).to(device)
        self._sync_alpha()
        return self.seed

    def advance(self, signals: GateSignals) -> GateResult:
        result = self.lifecycle.advance(signals)
        self._sync_alpha()
        return result

    def prune(self) -> None:
        """Cut the seed: the module and its parameters are dropped from the slot."""
        self.lifecycle.prune()
        self.seed = None
        self.gate = None
        self._sync_alpha()

    def end_epoch(self) -> SeedStage | None:
        entered = self.lifecycle.end_epoch()
        self._sync_alpha()
        return entered

    def _sync_alpha(self) -> None:
        self._alpha_t.fill_(self.alpha)  # a host-to-device fill, never a read

    # --------------------------------------------------------------- forward
    def forward(self, h: Tensor) -> Tensor:
        seed = self.seed
        stage = self.stage
        if seed is None or stage is SeedStage.GERMINATED:
            return h
        if stage is SeedStage.TRAINING:
            if not self.incubating:
                return h  # alpha 0: the host trains alone; the seed learns in incubation
            return h + seed(h.detach())
        delta = seed(h if stage is SeedStage.FOSSILIZED else h.detach())
        if self.gate is not None:
            delta = self.gate(delta)
        scale = self._cf_scale
        if scale is None:
            return h + self._alpha_t * delta
        # Counterfactual replicas: the batch is R copies of the input; replica r sees this
        # seed with alpha * scale[r].
        replicas = scale.shape[0]
        shaped = delta.unflatten(0, (replicas, -1))
        weights = (self._alpha_t * scale).view(replicas, *([1] * (shaped.dim() - 1)))
        return h + (shaped * weights).flatten(0, 1)

    def set_counterfactual_scale(self, scale: Tensor | None) -> None:
        """Per-replica alpha multipliers ``[R]`` for a fused counterfactual pass (None to clear)."""
        self._cf_scale = scale

    def extra_repr(self) -> str:
        bp = self.lifecycle.blueprint or "-"
        return f"id={self.slot_id}, stage={self.stage.name}, blueprint={bp}, alpha={self.alpha:.3f}"
