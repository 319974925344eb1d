"""A small causal Transformer host for token sequences, with a seed slot after each block."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from esper.kasmina.blueprints import SlotShape
from esper.kasmina.hosts.base import (
    CrossEntropyHost,
    check_widening_factor,
    integer_roundings,
)
from esper.kasmina.lifecycle import LifecycleConfig
from esper.kasmina.slot import SeedSlot
from esper.kasmina.widening import (
    MLPWidening,
    TensorMerge,
    columns,
    concat,
    output_gated_columns,
    rows,
)

#: The MLP's hidden width is this many times ``d_model`` unless ``mlp_hidden`` says otherwise.
MLP_RATIO = 4
DEFAULT_D_MODEL = 64
DEFAULT_N_HEADS = 4


class CausalBlock(nn.Module):
    """Pre-norm causal self-attention and MLP.

    ``mlp_hidden`` is the MLP's hidden width; None keeps ``MLP_RATIO * d_model``.
    """

    def __init__(self, d_model: int, n_heads: int, mlp_hidden: int | None = None) -> None:
        super().__init__()
        hidden = MLP_RATIO * d_model if mlp_hidden is None else mlp_hidden
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_mlp_input(x)[0]

    def forward_with_mlp_input(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The block's output and its MLP's input (what a widening of the MLP reads)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        mlp_in = self.ln2(x)
        return x + self.mlp(mlp_in), mlp_in


class TransformerHost(CrossEntropyHost):
    """Token and position embeddings, causal blocks with slot ``block{i}`` after each, LM head.

    ``mlp_hidden`` sets the blocks' MLP width apart from ``d_model``: None keeps
    ``MLP_RATIO * d_model``, the same network (and parameter names and shapes) as before
    the argument existed, so existing configs and checkpoints are unchanged. It exists
    so a widened host (:meth:`widened_kwargs`) can move its size in small steps.
    """

    kind = "transformer"

    def __init__(
        self,
        vocab_size: int = 16,
        seq_len: int = 32,
        d_model: int = DEFAULT_D_MODEL,
        n_heads: int = DEFAULT_N_HEADS,
        n_layers: int = 2,
        lifecycle: LifecycleConfig | None = None,
        mlp_hidden: int | None = None,
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("vocab_size", vocab_size, 2),
            ("seq_len", seq_len, 1),
            ("d_model", d_model, 1),
            ("n_heads", n_heads, 1),
            ("n_layers", n_layers, 1),
        ):
            if value < minimum:
                raise ValueError(f"TransformerHost.{name} must be >= {minimum}, got {value}")
        if d_model % n_heads:
            raise ValueError(
                f"TransformerHost.d_model ({d_model}) must be a multiple of n_heads ({n_heads})"
            )
        if mlp_hidden is not None and (
            isinstance(mlp_hidden, bool) or not isinstance(mlp_hidden, int) or mlp_hidden < 1
        ):
            raise ValueError(
                f"TransformerHost.mlp_hidden must be an int >= 1, or None for "
                f"{MLP_RATIO} * d_model, got {mlp_hidden!r}"
            )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.input_shape = (seq_len,)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            CausalBlock(d_model, n_heads, mlp_hidden) for _ in range(n_layers)
        )
        self.slots = nn.ModuleDict(
            {
                f"block{i}": SeedSlot(
                    f"block{i}",
                    SlotShape("transformer", d_model, (seq_len,), causal=True),
                    lifecycle,
                )
                for i in range(n_layers)
            }
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    @classmethod
    def from_data(
        cls,
        input_shape: tuple[int, ...],
        n_classes: int,
        lifecycle: LifecycleConfig | None = None,
        **kwargs: Any,
    ) -> TransformerHost:
        """Token data: ``input_shape`` is ``(seq_len,)`` and ``n_classes`` the vocabulary."""
        if len(input_shape) != 1:
            raise ValueError(
                f"TransformerHost needs token sequences shaped (seq_len,), got input_shape "
                f"{tuple(input_shape)}; use a token data module such as 'tokens'"
            )
        return cls(vocab_size=n_classes, seq_len=input_shape[0], lifecycle=lifecycle, **kwargs)

    @classmethod
    def widened_kwargs(cls, kwargs: Mapping[str, Any], factor: float) -> list[dict[str, Any]]:
        """``kwargs`` with ``d_model`` and ``mlp_hidden`` about ``factor`` times wider.

        Why both: ``d_model`` must stay a multiple of ``n_heads``, so alone it moves in
        steps of ``n_heads`` (64 -> 68 with 4 heads: about 13% more parameters), too
        coarse to land within 5% of a target. ``mlp_hidden`` moves by one unit, so the
        floor/ceil multiples of ``n_heads`` near ``d_model * factor`` times the floor/ceil
        of ``mlp_hidden * factor`` (the default ``MLP_RATIO * d_model`` when not given)
        cover the range finely. Where the base left ``mlp_hidden`` out and a candidate's
        equals the default for its ``d_model``, it is left out again, so factor 1
        gives the base arguments back. Heads, layers and the rest are unchanged.
        """
        factor = check_widening_factor(factor)
        d_model = kwargs.get("d_model", DEFAULT_D_MODEL)
        n_heads = kwargs.get("n_heads", DEFAULT_N_HEADS)
        given_hidden = kwargs.get("mlp_hidden")
        hidden = MLP_RATIO * d_model if given_hidden is None else given_hidden
        candidates = []
        for d, m in itertools.product(
            integer_roundings(d_model * factor, step=n_heads, minimum=n_heads),
            integer_roundings(hidden * factor),
        ):
            widened = {**kwargs, "d_model": d}
            if given_hidden is not None or m != MLP_RATIO * d:
                widened["mlp_hidden"] = m
            candidates.append(widened)
        return candidates

    def check_input(self, x: Tensor) -> None:
        if x.dim() != 2 or not 1 <= x.shape[1] <= self.seq_len:
            raise ValueError(
                f"TransformerHost expects token ids shaped [batch, T] with 1 <= T <= {self.seq_len}, "
                f"got {list(x.shape)}"
            )
        if x.is_floating_point() or x.dtype == torch.bool:
            raise ValueError(f"TransformerHost expects integer token ids, got dtype {x.dtype}")

    @contextmanager
    def mapped(self) -> Iterator[None]:
        """Under ``vmap``, attention by its plain math (matmuls and a softmax, each mapped
        in one kernel): the fused kernels have no batching rule and would run env by
        env."""
        with sdpa_kernel(SDPBackend.MATH):
            yield

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        positions = torch.arange(x.shape[1], device=x.device)
        h, mlp_in = self.blocks[0].forward_with_mlp_input(self.tok(x) + self.pos(positions))
        return self.forward_from_slot(0, h, mlp_in)

    def forward_from_slot(self, index: int, h: Tensor, context: Tensor | None = None) -> Tensor:
        """Slot ``i``'s context is block ``i``'s MLP input (what a widening seed reads)."""
        for i, (block, slot) in enumerate(zip(self.blocks, self.slots.values(), strict=True)):
            if i < index:
                continue
            if i > index:
                h, context = block.forward_with_mlp_input(h)
            h = slot(h, context)
        return self.head(self.ln_f(h))

    # ------------------------------------------------------------------ widening
    def widening_merges(self, slot_id: str) -> list[TensorMerge]:
        """Block ``i``'s MLP takes the seed's hidden units: rows of its first layer (and
        bias), columns of its second, the gate over the outputs folded in."""
        slot = self.slot(slot_id)
        seed = slot.seed
        if not isinstance(seed, MLPWidening):
            raise ValueError(f"slot {slot_id} holds no MLP widening seed to merge")
        up, down = self._mlp(slot_id)
        gate = None if slot.gate is None else torch.sigmoid(slot.gate.logit.detach())
        into_down = columns() if gate is None else output_gated_columns(gate)
        return [
            TensorMerge(up, "weight", rows, (seed.up.weight,)),
            TensorMerge(up, "bias", concat, (seed.up.bias,)),
            TensorMerge(down, "weight", into_down, (seed.down.weight,)),
        ]

    def widened_layers(self, slot_id: str) -> list[nn.Module]:
        return list(self._mlp(slot_id))

    def _mlp(self, slot_id: str) -> tuple[nn.Linear, nn.Linear]:
        block = self.blocks[self.slot_ids.index(slot_id)]
        return block.mlp[0], block.mlp[2]

    def sync_widths(self) -> None:
        for block in self.blocks:
            up, down = block.mlp[0], block.mlp[2]
            up.out_features = up.weight.shape[0]
            down.in_features = down.weight.shape[1]

    def loss_and_correct(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        loss = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
        correct = (outputs.argmax(dim=-1) == targets).sum()
        return loss, correct, targets.numel()
