"""Which aten operators launch a kernel on a GPU: the rule every operator count here uses.

Why a module of its own: ``operator_counts.py`` counts esper-lite's operators in esper-lite's
own environment, where nothing of Esper's can be imported (its package is also named
``esper``), so this file imports torch alone and is loaded there by path; both systems are
counted by the same rule.

Not counted: views (``OpOverload.is_view``); bare allocations and a Python scalar wrapped as
a host tensor (a kernel's argument), :data:`NO_KERNEL`; ``set_``, which points a tensor at
another storage (a ``deepcopy`` of a tensor runs one); and an operator whose tensor outputs
are all empty (torch returns before launching: a ``deepcopy`` of an empty tensor copies
nothing). A multi-tensor ``_foreach`` operator counts once, as CUDA runs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

#: Operators that launch no kernel by what they are.
NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "scalar_tensor",
        "_unsafe_view",
        "set_",
    }
)


def launches(func: Any, out: Any) -> bool:
    """Whether ``func``, which returned ``out``, launched a kernel (the module docstring)."""
    if func.is_view or func.overloadpacket.__name__ in NO_KERNEL:
        return False
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return not tensors or any(t.numel() > 0 for t in tensors)
