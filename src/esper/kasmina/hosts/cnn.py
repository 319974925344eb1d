"""A convolutional host for images, with a seed slot after each stage."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from esper.kasmina.blueprints import SlotShape
from esper.kasmina.hosts.base import (
    CrossEntropyHost,
    check_widening_factor,
    integer_roundings,
)
from esper.kasmina.hosts.folded import per_channel_folded
from esper.kasmina.lifecycle import LifecycleConfig
from esper.kasmina.slot import SeedSlot, SlotOutput
from esper.kasmina.widening import (
    KERNEL,
    LINEAR_AREA,
    ConvWidening,
    TensorMerge,
    block_diagonal,
    columns,
    concat,
    rows,
)

DEFAULT_CHANNELS: tuple[int, ...] = (16, 32, 64)
#: Two convs per stage by default; one (with channels 8, 16, 32) is esper-lite's host, for
#: like-for-like comparisons with the predecessor.
DEFAULT_CONVS_PER_STAGE = 2
POOL = 2
#: Narrowest stage (channels) from which the CPU runs a CNN host in channels-last layout;
#: below it the layout's batch norm costs more than its convolutions save (see
#: :func:`channels_last_on_cpu`).
CHANNELS_LAST_MIN_CHANNELS = 8


def max_pool_2x2(x: Tensor) -> Tensor:
    """2x2 max-pooling, stride 2, equal to ``F.max_pool2d(x, 2)`` value for value.

    Why not always ``F.max_pool2d``: on the CPU its forward is slow for these small
    NCHW maps, several times slower than the elementwise maximum of the four strided
    quarters here, and pooling was most of a validation forward of the predecessor's
    host (benchmarks/README.md, "Design figures kept out of docstrings"). Where a gradient is needed it stays:
    its backward is cheap and picks the first maximum of a window, which the maximum of
    quarters has no record of.
    """
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.max_pool2d(x, 2)
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    top = torch.maximum(x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2])
    return torch.maximum(top, torch.maximum(x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]))


def channels_last_on_cpu(x: Tensor) -> Tensor:
    """``x`` in channels-last (NHWC) memory layout on the CPU; elsewhere as it came.

    Why: on the CPU, oneDNN runs convolutions of 8 or more channels, their batch norm and
    the pooling much faster on NHWC maps than on NCHW ones; with 2 to 4 channels NHWC
    batch norm costs more than the convolutions save (benchmarks/README.md, "Design figures kept out of docstrings"), so
    :class:`CNNHost` asks for this only from :data:`CHANNELS_LAST_MIN_CHANNELS` up.
    Convolutions, batch norm, ReLU, pooling and the seeds keep the layout, so converting
    the input is enough. Values are those of the same network in NCHW up to float rounding
    (the convolutions sum in another order). CUDA keeps the layout it is given: not
    measured there.
    """
    return x.contiguous(memory_format=torch.channels_last) if x.device.type == "cpu" else x


class ConvStage(nn.Module):
    """``convs`` 3x3 conv-BN-ReLU layers at one resolution (no conv bias: BN has one)."""

    def __init__(self, c_in: int, c_out: int, convs: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(convs):
            layers += [
                nn.Conv2d(c_in if i == 0 else c_out, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
        self.body = nn.Sequential(*layers)

    @property
    def in_channels(self) -> int:
        return self.convs()[0].in_channels

    def convs(self) -> list[nn.Conv2d]:
        return [m for m in self.body if isinstance(m, nn.Conv2d)]

    def norms(self) -> list[nn.BatchNorm2d]:
        return [m for m in self.body if isinstance(m, nn.BatchNorm2d)]

    def forward(self, x: Tensor, first_extra: Tensor | None = None) -> Tensor:
        """``first_extra`` is added to the first convolution's first outputs: what a
        widening seed of the previous stage sends through its own weights."""
        if first_extra is None:
            return self.body(x)
        y = self.body[0](x)
        missing = y.shape[1] - first_extra.shape[1]
        if missing:
            first_extra = F.pad(first_extra, (0, 0, 0, 0, 0, missing))
        return self.body[1:](y + first_extra)


class CNNHost(CrossEntropyHost):
    """Stages of conv blocks; slot ``stage{i}`` sits after stage i, before its 2x2 pooling.

    ``convs_per_stage=1`` with ``channels=(8, 16, 32)`` is the predecessor's host (6 418
    parameters on 3x32x32 images and 10 classes), so the two systems can be timed on the
    same network.

    Pooling happens after a stage only while the feature map is larger than 1x1, so the
    same code serves 8x8 digits and 32x32 CIFAR-10 images.
    """

    kind = "cnn"
    #: Widening: the stages themselves grow, and gained several times more over no
    #: growth than residual blocks did, with fewer parameters and FLOPs
    #: (benchmarks/README.md, "Widening the host"). The residual blueprints stay
    #: registered for ``--model.blueprints``.
    default_blueprints = ("widen",)
    #: Convolution, batch norm in training mode, ReLU, both poolings and the linear head
    #: treat channels apart, and an all-zero channel stays zero through them, its weights'
    #: gradients zero.
    pads_widths_exactly = True

    def __init__(
        self,
        input_shape: Sequence[int] = (1, 8, 8),
        n_classes: int = 10,
        channels: Sequence[int] = DEFAULT_CHANNELS,
        lifecycle: LifecycleConfig | None = None,
        convs_per_stage: int = DEFAULT_CONVS_PER_STAGE,
    ) -> None:
        super().__init__()
        input_shape = tuple(int(s) for s in input_shape)
        if len(input_shape) != 3 or min(input_shape) < 1:
            raise ValueError(
                f"CNNHost.input_shape must be (channels, height, width) with positive sizes, "
                f"got {input_shape}"
            )
        if n_classes < 2:
            raise ValueError(f"CNNHost.n_classes must be >= 2, got {n_classes}")
        if not channels or min(channels) < 1:
            raise ValueError(f"CNNHost.channels must be non-empty positive widths, got {channels}")
        if isinstance(convs_per_stage, bool) or not isinstance(convs_per_stage, int):
            raise ValueError(
                f"CNNHost.convs_per_stage must be an int >= 1, got {convs_per_stage!r}"
            )
        if convs_per_stage < 1:
            raise ValueError(f"CNNHost.convs_per_stage must be an int >= 1, got {convs_per_stage}")
        self.input_shape = input_shape
        self.n_classes = n_classes
        self.stages = nn.ModuleList()
        self.pools: list[bool] = []
        self.slots = nn.ModuleDict()
        c_in, h, w = input_shape
        for i, c in enumerate(channels):
            self.stages.append(ConvStage(c_in, c, convs_per_stage))
            last = i == len(channels) - 1
            shape = SlotShape(
                "cnn",
                c,
                (h, w),
                producer_in=c_in,
                producer_layers=convs_per_stage,
                consumer_out=n_classes if last else channels[i + 1],
                consumer_area=LINEAR_AREA if last else KERNEL * KERNEL,
            )
            self.slots[f"stage{i}"] = SeedSlot(f"stage{i}", shape, lifecycle)
            pool = h >= POOL and w >= POOL
            self.pools.append(pool)
            if pool:
                h, w = h // POOL, w // POOL
            c_in = c
        self.head = nn.Linear(c_in, n_classes)
        #: On the CPU, run in channels-last layout (every stage at least 8 channels wide).
        self.channels_last = min(channels) >= CHANNELS_LAST_MIN_CHANNELS
        #: Set while mapped over envs (:meth:`mapped`).
        self._mapped = False

    @classmethod
    def from_data(
        cls,
        input_shape: tuple[int, ...],
        n_classes: int,
        lifecycle: LifecycleConfig | None = None,
        **kwargs: Any,
    ) -> CNNHost:
        return cls(input_shape=input_shape, n_classes=n_classes, lifecycle=lifecycle, **kwargs)

    @classmethod
    def widened_kwargs(cls, kwargs: Mapping[str, Any], factor: float) -> list[dict[str, Any]]:
        """``kwargs`` with every stage's channels about ``factor`` times wider.

        Each stage takes the floor or the ceiling of ``channels[i] * factor`` (at least 1),
        and every combination is offered (at most ``2 ** len(channels)``), so the counts
        of one factor are spread finely enough for a search to land near a target.
        ``channels`` come back as a list of ints, as a config writes them; the other
        arguments unchanged.
        """
        factor = check_widening_factor(factor)
        channels = kwargs.get("channels", DEFAULT_CHANNELS)
        per_stage = [integer_roundings(c * factor) for c in channels]
        return [{**kwargs, "channels": list(widths)} for widths in itertools.product(*per_stage)]

    def check_input(self, x: Tensor) -> None:
        if tuple(x.shape[1:]) != self.input_shape or x.dim() != 4:
            raise ValueError(
                f"CNNHost expects images shaped [batch, {', '.join(map(str, self.input_shape))}], "
                f"got {list(x.shape)}; build the host with input_shape matching the data module"
            )
        if not x.is_floating_point():
            raise ValueError(f"CNNHost expects floating-point images, got dtype {x.dtype}")

    @contextmanager
    def mapped(self) -> Iterator[None]:
        """Under ``vmap`` no channels-last conversion (vmap refuses it), and pooling runs
        on the envs folded into channels (``esper.kasmina.hosts.folded``), where the
        unwrapped map says whether it needs a gradient (a mapped one does not, and the
        CPU's pooling shortcut would split a tied window's gradient where
        ``F.max_pool2d`` gives it to the first maximum). The stages' ReLUs run out of place: a mapped activation is
        a view of the group's stacked one (the folded batch norm's output), and an
        in-place op on a view makes autograd keep a copy of the slices it wrote, a
        clone and copies in every backward (on a launch-bound GPU, 15 of a fresh
        16-env step's 76 kernels; the values and gradients are the same either way)."""
        in_place = [m for m in self._relus() if m.inplace]
        self._mapped = True
        for relu in in_place:
            relu.inplace = False
        try:
            yield
        finally:
            self._mapped = False
            for relu in in_place:
                relu.inplace = True

    def _relus(self) -> list[nn.ReLU]:
        """The stages' ReLUs (in place outside :meth:`mapped`)."""
        return [m for stage in self.stages for m in stage.body if isinstance(m, nn.ReLU)]

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        if self.channels_last and not self._mapped:
            x = channels_last_on_cpu(x)
        return self.forward_from_slot(0, self.stages[0](x), x)

    def forward_from_slot(self, index: int, h: Tensor, context: Tensor | None = None) -> Tensor:
        """Slot ``i``'s context is stage ``i``'s input. A widening seed's new channels
        leave its slot beside ``h``, are pooled as ``h`` is, and reach the next stage, or
        the head, through the seed's own weights (:meth:`SeedSlot.consume`)."""
        slots = list(self.slots.values())
        extra: Tensor | None = None
        for i in range(index, len(slots)):
            if i > index:
                context = h
                consumed = None if extra is None else slots[i - 1].consume(extra)
                h = self.stages[i](h, consumed)
            parts = slots[i](h, context, apart=True)
            if self.pools[i]:  # per sample and channel: pooled apart, joined after
                parts = SlotOutput(*(None if t is None else self._pool(t) for t in parts))
            h, extra = parts.rows_joined()
        logits = self.head(self._features(h))
        return logits if extra is None else logits + slots[-1].consume(self._features(extra))

    def _pool(self, h: Tensor) -> Tensor:
        # Mapped, the envs are folded into channels: the stacked map pools where it lies.
        return per_channel_folded(h, max_pool_2x2) if self._mapped else max_pool_2x2(h)

    @staticmethod
    def _features(h: Tensor) -> Tensor:
        return torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)

    # ------------------------------------------------------------------ widening
    def widening_merges(self, slot_id: str) -> list[TensorMerge]:
        """Stage ``i``'s convolutions and norms take the seed's channels (the first one's
        rows, later ones block-diagonally), and the next stage's first convolution, or the
        head, the seed's consumer weights as new input columns, its gate folded in."""
        i = self.slot_ids.index(slot_id)
        slot = self.slot(slot_id)
        seed = slot.seed
        if not isinstance(seed, ConvWidening):
            raise ValueError(f"slot {slot_id} holds no convolutional widening seed to merge")
        stage = self.stages[i]
        merges = []
        for j, (conv, new) in enumerate(zip(stage.convs(), seed.convs(), strict=True)):
            merges.append(
                TensorMerge(conv, "weight", rows if j == 0 else block_diagonal, (new.weight,))
            )
        for norm, new in zip(stage.norms(), seed.norms(), strict=True):
            for name in ("weight", "bias", "running_mean", "running_var"):
                merges.append(TensorMerge(norm, name, concat, (getattr(new, name),)))
        gate = None if slot.gate is None else torch.sigmoid(slot.gate.logit.detach())
        consumer = self._consumer(i)
        merges.append(TensorMerge(consumer, "weight", columns(gate), (seed.consumer.weight,)))
        return merges

    def widened_layers(self, slot_id: str) -> list[nn.Module]:
        i = self.slot_ids.index(slot_id)
        stage = self.stages[i]
        return [*stage.convs(), *stage.norms(), self._consumer(i)]

    def _consumer(self, i: int) -> nn.Module:
        """The layer that reads stage ``i``'s output: the next stage's first conv, or the head."""
        return self.stages[i + 1].convs()[0] if i + 1 < len(self.stages) else self.head

    def sync_widths(self) -> None:
        """Make each layer's width attributes match its (merged) weights."""
        for stage in self.stages:
            for conv in stage.convs():
                conv.out_channels, conv.in_channels = conv.weight.shape[:2]
            for norm in stage.norms():
                norm.num_features = norm.weight.shape[0]
        self.head.in_features = self.head.weight.shape[1]

    def loss_and_correct(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        loss = F.cross_entropy(outputs, targets)
        correct = (outputs.argmax(dim=-1) == targets).sum()
        return loss, correct, targets.shape[0]
