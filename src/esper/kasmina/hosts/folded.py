"""Per-channel ops of a host mapped over envs, run with the envs folded into channels.

Why: under ``torch.func.vmap`` (``esper.tolaria.stacked`` maps a host's forward over the
envs of a group) a convolution with stacked weights is one grouped convolution whose
batching rule leaves its output with the env dimension second, ``[b, G, C, H, W]``, while
functorch's pooling rule wants it first: it copies the map to ``[G*b, C, H, W]``, pools,
and the next convolution copies it back. On a launch-bound GPU those copies (and their
backward's) were about 19 of a stacked step's 218 kernels on the predecessor's host. A
pooling window never crosses a channel, so G envs' ``[b, C, H, W]`` maps pooled are exactly
one ``[b, G*C, H, W]`` map pooled: a view where the env dimension is second, as the
convolution left it, and the result stays there for the next one. Values and gradients are
the same op's on the same windows, so they equal functorch's bit for bit
(``tests/kasmina/hosts/test_folded.py``).

Inside ``vmap`` the mapped tensor is unwrapped to its stacked form and the result wrapped
back, as torch's own ``torch.library.register_vmap`` does and as the stacked batch norm
(``esper.tolaria.stacked_norm``) does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch._C import _functorch

#: Excluding this key runs ops on the unwrapped (stacked) tensors below the vmap level.
BELOW_VMAP = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)


def per_channel_folded(x: Tensor, op: Callable[[Tensor], Tensor]) -> Tensor:
    """``op(x)`` for an ``op`` that treats each sample's channels apart (pooling), where
    ``x`` (logically ``[b, C, ...]``) may be mapped by ``vmap``: then ``op`` runs once on
    ``[b, G*C, ...]``, the envs folded into channels, and the result is mapped with the env
    dimension second. Outside ``vmap``, or where ``x`` is not mapped at the current level,
    ``op(x)``."""
    level = _functorch.maybe_current_level()
    if level is None:
        return op(x)
    stacked, dim = _functorch._unwrap_batched(x, level)
    if dim is None:
        return op(x)
    per_sample = stacked.movedim(dim, 1)  # [b, G, C, ...]: a view where dim is 1
    b, g, c = per_sample.shape[:3]
    with torch._C._ExcludeDispatchKeyGuard(BELOW_VMAP):
        out = op(per_sample.reshape(b, g * c, *per_sample.shape[3:]))
    return _functorch._add_batch_dim(out.reshape(b, g, c, *out.shape[2:]), 1, level)
