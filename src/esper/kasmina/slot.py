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
        # During a counterfactual pass: how many replicas of the batch reach this slot.
        self._cf_fork: int | None = None
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
        return self._hold(module, blend_mode)

    def build_fossilized(self, blueprint: str | Blueprint, blend_mode: BlendMode) -> nn.Module:
        """Put a seed built from ``blueprint`` here as part of the host, at alpha 1, before
        any training (a static network: see :meth:`SeedLifecycle.build_fossilized`)."""
        bp = BLUEPRINTS.get(blueprint) if isinstance(blueprint, str) else blueprint
        module = bp.instantiate(self.shape)
        self.lifecycle.build_fossilized(bp.name, blend_mode)
        return self._hold(module, blend_mode)

    def _hold(self, module: nn.Module, blend_mode: BlendMode) -> nn.Module:
        """Keep ``module`` as this slot's seed, on the host's device, gated if asked."""
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
        out = h + self._alpha_t * delta
        live = self._cf_fork
        if live is None:
            return out
        # Counterfactual pass: ``h`` stacks ``live`` replicas of the batch, which differ only
        # by the seeds switched off upstream. Every replica keeps this seed; one more, replica
        # 0's input without it, is appended. Until the first such slot the replicas would be
        # identical, so the host runs that prefix once.
        return torch.cat([out, h[: h.shape[0] // live]])

    def set_counterfactual_fork(self, live: int | None) -> None:
        """Fork a counterfactual replica here: ``live`` replicas arrive (None to clear).

        The ``k``-th contributing slot in forward order (from 1) gets ``live = k``, so a
        batch of ``B`` samples leaves it as ``(k + 1) * B`` rows, replica ``k`` being the
        host with that slot's seed switched off (see ``esper.tolaria.counterfactual``).
        """
        if live is not None and live < 1:
            raise ValueError(f"a counterfactual fork needs at least 1 live replica, got {live}")
        self._cf_fork = live

    def extra_repr(self) -> str:
        bp = self.lifecycle.blueprint or "-"
        return f"id={self.slot_id}, stage={self.stage.name}, blueprint={bp}, alpha={self.alpha:.3f}"
