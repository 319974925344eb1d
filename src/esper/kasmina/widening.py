"""Seeds that widen the host: new units of its layers, merged into them when fossilized.

A residual seed adds a block beside its slot's activation at the slot's own width, so a
narrow host stays narrow however many seeds it grows. A widening seed adds units to the
layers around the slot instead:

* on a CNN slot, ``units`` more output channels for every convolution of the stage
  before it (:class:`ConvWidening`), read by the layer after it (the next stage's first
  convolution, or the head). The new channels travel beside the stage's output
  (``[h, alpha * e]`` along channels; the CNN host keeps them as a tensor of their own)
  through the slot and the pooling, and the consumer reads them through the seed's own
  weights;
* on a Transformer slot, ``units`` more hidden units of the block's MLP
  (:class:`MLPWidening`), which add into the residual stream as the MLP's own units do.

Either way the new units' outgoing weights start at zero (Net2Net's and GradMax's
function-preserving start), so germinating changes nothing the host computes. While the
seed lives, the host's old units never read the new ones (the merged weights there are
zero), which is what lets alpha, the gate and the counterfactual switch the seed off by
scaling only its outgoing path. When the seed is fossilized, :func:`merge_widening`
concatenates its weights into the host's layers (momentum buffers too), so the host is
then a plain wider network computing the same function, and the blocks that were kept
at zero start to train with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from esper.kasmina.blueprints.layers import zero_
from esper.kasmina.blueprints.spec import SlotShape
from esper.kasmina.sgd import MOMENTUM_BUFFER

#: Where a widening's output goes: beside the slot's activation (CNN channels), or added
#: into it (a Transformer's residual stream).
CONCAT = "concat"
ADD = "add"
#: ``consumer_area`` of a consumer that reads one value per channel (a linear head).
LINEAR_AREA = 1
KERNEL = 3


class Widening(nn.Module):
    """New units for the layers around one slot. ``forward(context)`` computes them from
    what the host hands the slot beside its activation; ``join`` says where they go."""

    join: str = CONCAT
    #: How many units the seed adds.
    units: int
    #: The width of ``forward``'s output: what a gate scales, channel by channel.
    gate_channels: int
    #: The slot shape it was built for (``keep`` builds the smaller copy from it).
    shape: SlotShape

    def consume(self, extra: Tensor) -> Tensor:
        """The consumer's input from the new units ``extra`` (CONCAT widenings only)."""
        raise NotImplementedError(f"{type(self).__name__} adds its output; nothing consumes it")

    def outgoing(self) -> Tensor:
        """The weights the new units feed the host through, units along axis 1."""
        raise NotImplementedError

    def keep(self, index: Tensor) -> Widening:
        """A copy holding only units ``index`` (a device tensor: no host read)."""
        raise NotImplementedError


@torch.no_grad()
def _take(dst: Tensor, src: Tensor, index: Tensor, dims: Sequence[int]) -> None:
    for d in dims:
        src = src.index_select(d, index)
    dst.copy_(src)


def unit_scores(seed: Widening) -> Tensor:
    """``[units]``: the norm of the loss gradient on each unit's outgoing weights.

    Why it ranks units: with outgoing weights at zero the loss does not depend on a new
    unit yet, and this is how fast it would fall as the unit's outgoing weights start to
    move (the first-order criterion Firefly and GradMax select new neurons by).
    """
    grad = seed.outgoing().grad
    if grad is None:
        raise ValueError("unit_scores needs the gradient of a loss on the seed's outgoing weights")
    return grad.transpose(0, 1).flatten(1).norm(dim=1)


class ConvWidening(Widening):
    """``units`` more channels of every convolution in a CNN stage, and their consumer.

    The new channels are a narrow copy of the stage (conv-BN-ReLU per layer) reading the
    stage's input as the host was built (its first ``producer_in`` channels: channels
    merged since then are later ones, read through zero columns once this seed merges).
    """

    join = CONCAT

    def __init__(self, shape: SlotShape, units: int) -> None:
        super().__init__()
        self.units = self.gate_channels = units
        self.shape = shape
        self.producer_in = shape.producer_in
        layers: list[nn.Module] = []
        for j in range(shape.producer_layers):
            c_in = shape.producer_in if j == 0 else units
            layers += [
                nn.Conv2d(c_in, units, KERNEL, padding=KERNEL // 2, bias=False),
                nn.BatchNorm2d(units),
                nn.ReLU(),
            ]
        self.body = nn.Sequential(*layers)
        if shape.consumer_area == LINEAR_AREA:
            self.consumer: nn.Module = nn.Linear(units, shape.consumer_out, bias=False)
        else:
            self.consumer = nn.Conv2d(
                units, shape.consumer_out, KERNEL, padding=KERNEL // 2, bias=False
            )
        zero_(self.consumer)

    def forward(self, context: Tensor) -> Tensor:
        return self.body(context[:, : self.producer_in])

    def consume(self, extra: Tensor) -> Tensor:
        return self.consumer(extra)

    def convs(self) -> list[nn.Conv2d]:
        return [m for m in self.body if isinstance(m, nn.Conv2d)]

    def norms(self) -> list[nn.BatchNorm2d]:
        return [m for m in self.body if isinstance(m, nn.BatchNorm2d)]

    def outgoing(self) -> Tensor:
        return self.consumer.weight

    def keep(self, index: Tensor) -> ConvWidening:
        """Units ``index``: their rows of every convolution (and, after the first, their
        columns), their norm parameters; statistics and outgoing weights start afresh."""
        kept = ConvWidening(self.shape, index.numel()).to(index.device)
        for j, (dst, src) in enumerate(zip(kept.convs(), self.convs(), strict=True)):
            _take(dst.weight, src.weight, index, (0,) if j == 0 else (0, 1))
        for dst, src in zip(kept.norms(), self.norms(), strict=True):
            _take(dst.weight, src.weight, index, (0,))
            _take(dst.bias, src.bias, index, (0,))
        return kept


class MLPWidening(Widening):
    """``units`` more hidden units of a Transformer block's MLP: ``down(gelu(up(x)))`` on
    the MLP's input, added to the block's output as the MLP's own units are."""

    join = ADD

    def __init__(self, shape: SlotShape, units: int) -> None:
        super().__init__()
        self.units = units
        self.gate_channels = shape.channels
        self.shape = shape
        self.up = nn.Linear(shape.channels, units)
        self.act = nn.GELU()
        self.down = zero_(nn.Linear(units, shape.channels, bias=False))

    def forward(self, context: Tensor) -> Tensor:
        return self.down(self.act(self.up(context)))

    def outgoing(self) -> Tensor:
        return self.down.weight

    def keep(self, index: Tensor) -> MLPWidening:
        kept = MLPWidening(self.shape, index.numel()).to(index.device)
        _take(kept.up.weight, self.up.weight, index, (0,))
        _take(kept.up.bias, self.up.bias, index, (0,))
        return kept


# ----------------------------------------------------------------------------- merging
@dataclass(frozen=True)
class TensorMerge:
    """One host tensor (``module.name``, a parameter or a buffer) replaced by
    ``combine(host, *sources)``, ``sources`` being the seed's tensors it absorbs.

    The same ``combine`` builds the merged momentum buffer from the host's and the
    seed's (zeros where one has none), so training goes on from where both were.
    """

    module: nn.Module
    name: str
    combine: Callable[..., Tensor]
    sources: tuple[Tensor, ...] = ()


def rows(old: Tensor, new: Tensor) -> Tensor:
    """Append ``new``'s rows (output units) to ``old``, zero-padding ``new``'s columns
    (inputs) up to ``old``'s: inputs merged after the seed was planted, never read by it."""
    return torch.cat([old, _pad_dim(new, 1, old.shape[1])], dim=0)


def columns(scale: Tensor | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """Append ``new``'s columns (inputs) to ``old``, zero-padding ``new``'s rows
    (outputs) up to ``old``'s; ``scale`` (per new column) folds a gate in."""

    def combine(old: Tensor, new: Tensor) -> Tensor:
        if scale is not None:
            new = new * scale.view(1, -1, *([1] * (new.dim() - 2)))
        return torch.cat([old, _pad_dim(new, 0, old.shape[0])], dim=1)

    return combine


def output_gated_columns(scale: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """Append ``new``'s columns to ``old`` with each of ``new``'s rows times ``scale``
    (a gate over the outputs, folded into the weights that produce them)."""

    def combine(old: Tensor, new: Tensor) -> Tensor:
        return torch.cat([old, new * scale.view(-1, *([1] * (new.dim() - 1)))], dim=1)

    return combine


def block_diagonal(old: Tensor, new: Tensor) -> Tensor:
    """``[[old, 0], [0, new]]`` over the first two axes: the old units keep reading only
    old units, the new only new ones, as they did while the seed lived."""
    top = _pad_dim(old, 1, old.shape[1] + new.shape[1])
    bottom = torch.cat([old.new_zeros(new.shape[0], old.shape[1], *old.shape[2:]), new], dim=1)
    return torch.cat([top, bottom], dim=0)


def concat(old: Tensor, new: Tensor) -> Tensor:
    """Per-unit vectors (biases, norm weights, running statistics) end to end."""
    return torch.cat([old, new])


def _pad_dim(t: Tensor, dim: int, size: int) -> Tensor:
    missing = size - t.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad axis {dim} of {tuple(t.shape)} down to {size}")
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


@torch.no_grad()
def apply_merges(
    merges: Sequence[TensorMerge], optimizers: Iterable[torch.optim.Optimizer] = ()
) -> None:
    """Replace each merged tensor in place (a parameter keeps its identity, so the host
    optimizer still holds it) and merge its momentum from ``optimizers``' states.

    The merged momentum goes into the optimizer that holds the host parameter, built
    from the host's and the seed's buffers, zeros for one that has none yet. Gradients of
    the replaced parameters are dropped (their shapes no longer fit).
    """
    momenta: dict[int, Tensor] = {}
    holder: dict[int, torch.optim.Optimizer] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                holder[id(p)] = opt
                buf = opt.state.get(p, {}).get(MOMENTUM_BUFFER)
                if buf is not None:
                    momenta[id(p)] = buf
    for m in merges:
        target = getattr(m.module, m.name)
        old = target.detach()
        merged = m.combine(old, *(s.detach() for s in m.sources))
        if not isinstance(target, nn.Parameter):
            setattr(m.module, m.name, merged)  # a registered buffer: replaced by name
            continue
        target.data = merged
        target.grad = None
        bufs = [momenta.get(id(t)) for t in (target, *m.sources)]
        opt = holder.get(id(target))
        if opt is None or all(b is None for b in bufs):
            continue
        parts = [
            torch.zeros_like(t) if b is None else b
            for b, t in zip(bufs, (old, *m.sources), strict=True)
        ]
        opt.state[target][MOMENTUM_BUFFER] = m.combine(*parts)


def reset_modules(modules: Iterable[nn.Module]) -> None:
    """Draw fresh default initial values for ``modules`` (their ``reset_parameters``)."""
    for module in modules:
        reset = getattr(module, "reset_parameters", None)
        if reset is not None:
            reset()


__all__ = [
    "ADD",
    "CONCAT",
    "ConvWidening",
    "MLPWidening",
    "TensorMerge",
    "Widening",
    "apply_merges",
    "block_diagonal",
    "columns",
    "concat",
    "output_gated_columns",
    "reset_modules",
    "rows",
    "unit_scores",
]
