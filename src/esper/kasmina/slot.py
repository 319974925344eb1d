"""A slot in a host where one seed can grow, and the forward rule that blends it in.

``forward(h) = h + alpha * seed(h_in)`` where ``h_in`` is ``h`` detached until the seed is
fossilized: the seed's path never sends gradients back into the host's earlier layers.
A widening seed (``esper.kasmina.widening``) reads the ``context`` the host hands the slot
beside ``h`` instead, and its output either joins ``h`` along channels (``[h, alpha *
seed(context)]``, read by the host's next layer) or is added to it; fossilizing it merges
it into the host's layers (:meth:`SeedSlot.absorb`), after which the slot passes ``h`` on.

While TRAINING, alpha is 0: the slot passes ``h`` through, so the host trains exactly as
it would alone. The seed learns in a separate pass (``esper.kasmina.incubation``) in
which the slot is ``incubating`` and adds the seed at full strength against a frozen
host, so it leaves TRAINING as a fitted residual.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from esper.contracts import BlendMode, SeedStage
from esper.kasmina.blueprints import BLUEPRINTS, Blueprint, SlotShape
from esper.kasmina.lifecycle import GateResult, GateSignals, LifecycleConfig, SeedLifecycle
from esper.kasmina.widening import CONCAT, Widening

#: A GATED seed's per-channel gate starts at sigmoid(GATE_INIT_LOGIT) ~ 0.95: almost open,
#: so blending proceeds as scheduled unless the seed learns to shut channels.
GATE_INIT_LOGIT = 3.0


class SlotOutput(NamedTuple):
    """A slot's output in parts (``SeedSlot.forward(..., apart=True)``).

    ``out``: the host's activation with the seed applied. ``extra``: the new channels a
    CONCAT widening puts beside it, or None. ``replica``: in a counterfactual pass, the
    replica the slot appends after ``out``'s rows (replica 0's input without the seed;
    ``extra`` is zero on its rows), or None. Pooling works per sample and per channel,
    so a host may pool each part before it joins them.
    """

    out: Tensor
    extra: Tensor | None = None
    replica: Tensor | None = None

    def rows_joined(self) -> tuple[Tensor, Tensor | None]:
        """``(out, extra)`` with the replica appended along rows (``extra`` zero there)."""
        out, extra = self.out, self.extra
        if self.replica is not None:
            if extra is not None:
                extra = torch.cat([extra, torch.zeros_like(extra[: self.replica.shape[0]])])
            out = torch.cat([out, self.replica])
        return out, extra

    def joined(self) -> Tensor:
        """The parts as one tensor: replicas along rows, new channels along dim 1."""
        out, extra = self.rows_joined()
        return out if extra is None else torch.cat([out, extra], dim=1)


class ChannelGate(nn.Module):
    """A learned per-channel gate in (0, 1) multiplied onto a seed's output (BlendMode.GATED)."""

    def __init__(self, shape: SlotShape, channels: int | None = None) -> None:
        super().__init__()
        self.channel_dim = 1 if shape.kind == "cnn" else -1
        width = shape.channels if channels is None else channels
        self.logit = nn.Parameter(torch.full((width,), GATE_INIT_LOGIT))

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
        #: The value last written into ``_alpha_t`` (copied with it by deepcopy and pickle;
        #: a state dict holds neither): a lifecycle op whose alpha did not move writes
        #: nothing, where a fill was a kernel launch on a GPU (a slot an env an epoch).
        self._alpha_written = 0.0
        # What the incubation pass multiplies a TRAINING seed's output by where
        # ``scale_incubation`` asks: always 1 here; the stacked engine runs it as 0 for the
        # members of a group that do not have the seed (``esper.tolaria.stacked``).
        self.register_buffer("_incubation_t", torch.ones(()), persistent=False)
        # During a counterfactual pass: how many replicas of the batch reach this slot.
        self._cf_fork: int | None = None
        #: Set during the incubation pass: a TRAINING seed then adds its output at alpha 1.
        self.incubating = False
        #: Set by the stacked engine around its incubation pass: the seed's output is then
        #: multiplied by :attr:`incubation_tensor`. Off, it is added as it is: multiplying
        #: by 1 changes no value but costs a full-size tensor a step.
        self.scale_incubation = False
        #: Parameters a widening seed added to the host's layers when it was merged
        #: (set by ``HostModel.merge_widening``).
        self.merged_params = 0

    # ------------------------------------------------------------------ queries
    @property
    def stage(self) -> SeedStage:
        return self.lifecycle.stage

    @property
    def alpha(self) -> float:
        return self.lifecycle.alpha

    @property
    def alpha_tensor(self) -> Tensor:
        """The device scalar the forward multiplies a blending seed's output by (a
        non-persistent buffer, kept equal to :attr:`alpha` by every lifecycle op)."""
        return self._alpha_t

    @property
    def incubation_tensor(self) -> Tensor:
        """The device scalar the incubation pass multiplies the seed's output by where
        :attr:`scale_incubation` is set: 1."""
        return self._incubation_t

    @property
    def has_seed(self) -> bool:
        return self.seed is not None

    @property
    def widens(self) -> bool:
        """The seed is a widening (new units of the host's layers), not a residual block."""
        return isinstance(self.seed, Widening)

    @property
    def merged(self) -> bool:
        """A widening seed grew here and is now part of the host's layers."""
        return self.merged_params > 0

    @property
    def blends_output(self) -> bool:
        """True when the seed's output changes what the host computes (alpha may be > 0)."""
        return (self.seed is not None or self.merged) and self.stage in (
            SeedStage.BLENDING,
            SeedStage.HOLDING,
            SeedStage.FOSSILIZED,
        )

    def seed_parameters(self) -> Iterator[nn.Parameter]:
        for module in (self.seed, self.gate):
            if module is not None:
                yield from module.parameters()

    def seed_param_count(self) -> int:
        """Parameters the seed added: its own, or those it brought into the host's layers."""
        return self.merged_params + sum(p.numel() for p in self.seed_parameters())

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
        # Built on the CPU; uploaded without waiting for the device (a blocking upload
        # from pageable memory synchronises the stream: once per tensor, mid-rollout).
        self.seed = module.to(device, non_blocking=True)
        if BlendMode(blend_mode) is BlendMode.GATED:
            channels = module.gate_channels if isinstance(module, Widening) else None
            self.gate = ChannelGate(self.shape, channels).to(device, non_blocking=True)
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

    def replace_seed(self, module: nn.Module) -> None:
        """Hold ``module`` instead of the seed just planted (a widening's chosen units:
        ``esper.kasmina.widen_init``), before anything has trained it."""
        if self.stage is not SeedStage.GERMINATED or self.lifecycle.blend_mode is None:
            raise ValueError(
                f"slot {self.slot_id} can replace only a seed just germinated, not one in "
                f"{self.stage.name}"
            )
        self.gate = None
        self._hold(module, self.lifecycle.blend_mode)

    def absorb(self, merged_params: int) -> None:
        """Let go of a widening seed the host has merged into its layers, adding
        ``merged_params`` to them (:meth:`esper.kasmina.hosts.base.HostModel.merge_widening`)."""
        if not self.widens or self.stage is not SeedStage.FOSSILIZED:
            raise ValueError(
                f"slot {self.slot_id} can absorb only a fossilized widening seed; it holds "
                f"{type(self.seed).__name__} in {self.stage.name}"
            )
        self.merged_params = merged_params
        self.seed = None
        self.gate = None

    def consume(self, extra: Tensor) -> Tensor:
        """What the host's next layer gets from the new channels ``extra`` this slot's
        widening seed put beside its output."""
        if not isinstance(self.seed, Widening):
            raise ValueError(
                f"slot {self.slot_id} passed on {extra.shape[1]} channels more than the host "
                "has, but holds no widening seed to read them"
            )
        return self.seed.consume(extra)

    def end_epoch(self) -> SeedStage | None:
        entered = self.lifecycle.end_epoch()
        self._sync_alpha()
        return entered

    def _sync_alpha(self) -> None:
        alpha = self.alpha
        if alpha != self._alpha_written:
            self._alpha_t.fill_(alpha)  # a host-to-device fill, never a read
            self._alpha_written = alpha

    # --------------------------------------------------------------- forward
    def forward(
        self, h: Tensor, context: Tensor | None = None, apart: bool = False
    ) -> Tensor | SlotOutput:
        """The slot's output from the host's activation ``h``; ``context`` is what a
        widening seed reads (the stage's input, the MLP's input), None where the host
        offers none.

        With ``apart``, a :class:`SlotOutput`: a CONCAT widening's new channels, and in a
        counterfactual pass the replica this slot appends, come back on their own instead
        of concatenated, so that a host that pools them first and concatenates after
        (:class:`~esper.kasmina.hosts.cnn.CNNHost`) copies a quarter as much, and never
        splits the new channels off again (on the CPU those copies, the split's backward
        and their page faults took about a fifth of a training step of the predecessor's
        host with a widening in every stage, under torch's profiler)."""
        parts = self._forward_apart(h, context)
        return parts if apart else parts.joined()

    def _forward_apart(self, h: Tensor, context: Tensor | None) -> SlotOutput:
        seed = self.seed
        stage = self.stage
        if seed is None:
            return SlotOutput(h)
        source = h
        if isinstance(seed, Widening):
            if context is None:
                raise ValueError(
                    f"slot {self.slot_id} holds a widening seed but the host passed no "
                    "context; a host that offers widen must call slot(h, context)"
                )
            source = context
        if stage is SeedStage.GERMINATED or stage is SeedStage.TRAINING:
            if not self.incubating:
                # alpha 0: the host trains alone; the seed learns in incubation
                return SlotOutput(h)
            # A seed-only pass: incubation (TRAINING), or choosing a widening's units.
            delta = seed(source.detach())
            if self.scale_incubation:
                delta = self._incubation_t * delta
            return self._join(h, delta)
        delta = seed(source if stage is SeedStage.FOSSILIZED else source.detach())
        if self.gate is not None:
            delta = self.gate(delta)
        out = self._join(h, self._alpha_t * delta)
        live = self._cf_fork
        if live is None:
            return out
        # Counterfactual pass: ``h`` stacks ``live`` replicas of the batch, which differ only
        # by the seeds switched off upstream. Every replica keeps this seed; one more, replica
        # 0's input without it, is appended (a widening's new channels zero there). Until
        # the first such slot the replicas would be identical, so the host runs that prefix
        # once.
        return out._replace(replica=h[: h.shape[0] // live])

    def _join(self, h: Tensor, delta: Tensor) -> SlotOutput:
        """``h`` and the seed's ``delta``: beside it (a CONCAT widening), or added."""
        if isinstance(self.seed, Widening) and self.seed.join == CONCAT:
            return SlotOutput(h, extra=delta)
        return SlotOutput(h + delta)

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
