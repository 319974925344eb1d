"""A categorical over logits with a legality mask, computed entirely on the device.

``torch.distributions.Categorical`` validates its arguments and samples through
``multinomial``; both can read values on the host. This one is a few tensor ops:

* illegal logits are set to the most negative *finite* value of their dtype, not
  ``-inf``: their probability underflows to exactly 0, yet ``p * log p`` and its
  gradient stay finite, so entropy never turns into NaN;
* a row with no legal choice is made all-legal with ``mask | ~mask.any(-1)``, on the
  device. Such rows belong to heads the chosen op does not use (the slot row of WAIT):
  any sample is fine there because the policy leaves that head out of the log-prob;
* sampling is Gumbel-max (``argmax(logits + Gumbel noise)``), which takes a generator
  and needs no host read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def masked_logits(logits: Tensor, mask: Tensor) -> Tensor:
    """``logits`` with illegal entries replaced by ``finfo(dtype).min``; same shape."""
    return torch.where(mask, logits, torch.finfo(logits.dtype).min)


def ensure_any_legal(mask: Tensor) -> Tensor:
    """``mask`` with every all-False row along the last dim turned all-True (device-side)."""
    return mask | ~mask.any(dim=-1, keepdim=True)


class MaskedCategorical:
    """Independent categoricals over the last dim of ``logits [*B, K]`` under ``mask [*B, K]``.

    ``sample``/``mode``/``log_prob`` return or take indices ``[*B]``; ``entropy`` is ``[*B]``.
    """

    def __init__(self, logits: Tensor, mask: Tensor) -> None:
        if logits.shape != mask.shape:
            raise ValueError(
                f"MaskedCategorical: logits shape {tuple(logits.shape)} != mask shape "
                f"{tuple(mask.shape)}; pass one mask entry per logit"
            )
        if mask.dtype != torch.bool:
            raise TypeError(f"MaskedCategorical: mask must be bool, got {mask.dtype}")
        self.mask = ensure_any_legal(mask)
        self.logits = masked_logits(logits, self.mask)
        self.log_probs = torch.log_softmax(self.logits, dim=-1)

    @property
    def probs(self) -> Tensor:
        """``[*B, K]``; exactly 0 on illegal entries."""
        return self.log_probs.exp()

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        """Gumbel-max draw ``[*B]`` (long); never an illegal index."""
        finfo = torch.finfo(self.logits.dtype)
        u = torch.rand(
            self.logits.shape,
            dtype=self.logits.dtype,
            device=self.logits.device,
            generator=generator,
        )
        # Clamped into (0, 1) so the Gumbel noise -log(-log(u)) is finite.
        gumbel = -torch.log(-torch.log(u.clamp_(min=finfo.tiny, max=1.0 - finfo.eps)))
        # Illegal entries keep finfo.min: adding a bounded noise cannot lift them above a
        # legal entry, and the where() makes that explicit rather than numerical.
        noisy = torch.where(self.mask, self.logits + gumbel, finfo.min)
        return noisy.argmax(dim=-1)

    def mode(self) -> Tensor:
        """Most likely legal index ``[*B]`` (long)."""
        return self.logits.argmax(dim=-1)

    def log_prob(self, actions: Tensor) -> Tensor:
        """Log-probability ``[*B]`` of ``actions [*B]`` (long)."""
        return self.log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> Tensor:
        """Entropy ``[*B]`` over the legal entries only."""
        p_log_p = torch.where(self.mask, self.probs * self.log_probs, 0.0)
        return -p_log_p.sum(dim=-1)


def padded_heads(logits: Sequence[Tensor], masks: Sequence[Tensor]) -> MaskedCategorical:
    """Categoricals of different widths, ``logits[h] [*B, K_h]`` under ``masks[h]``, as one
    :class:`MaskedCategorical` over ``[*B, H, max K_h]``; it takes actions ``[*B, H]``.

    Each head is padded with illegal entries, whose probability is exactly 0, so each
    head's log-probabilities and entropy are those of its own categorical (up to the
    order of a float sum: the padding adds exact zeros). A row with no legal entry is made
    all-legal, padding included, as ``ensure_any_legal`` does alone; the padding keeps its
    lowest logit there, so it still takes probability 0. Why: the heads then score in one
    set of operators, not one set each; a PPO update scores four heads every minibatch
    (``PolicyNetwork._scored_heads``).

    Raises:
        ValueError: the two sequences differ in length or are empty.
    """
    if len(logits) != len(masks) or not logits:
        raise ValueError(
            f"padded_heads needs one mask per head and at least one head, got "
            f"{len(logits)} logits and {len(masks)} masks"
        )
    width = max(head.shape[-1] for head in logits)
    lowest = torch.finfo(logits[0].dtype).min
    padded_logits = torch.stack(
        [F.pad(head, (0, width - head.shape[-1]), value=lowest) for head in logits], dim=-2
    )
    padded_masks = torch.stack(
        [F.pad(mask, (0, width - mask.shape[-1]), value=False) for mask in masks], dim=-2
    )
    return MaskedCategorical(padded_logits, padded_masks)
