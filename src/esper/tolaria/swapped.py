"""A model's forward run with other tensors in its parameters' and buffers' places.

Why not ``torch.func.functional_call``: it finds where each named tensor lives by walking
the model's module tree on every call (and checks for tied tensors): 0.2 to 0.6 ms of
Python a call for a grown host of the predecessor's size on this project's CPU (a forward
of one image; five alternating rounds of 1000 calls, where this swap ran within the
noise of the plain forward), twice a stacked step (the host's pass and the incubation
pass), where a stacked step of 16 envs is a few milliseconds of launches on a GPU. Within a stacked group's epoch the template's
structure does not change, so the places are found once: every module's parameter or
buffer slot holding each named tensor (a tied tensor has several), filled as
``functional_call`` fills them (the module's ``_parameters`` or ``_buffers`` entry) and
put back after the forward, also when it raises. What a call does not name keeps the
model's own tensor, as with ``functional_call(strict=False)``.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

#: A module's ``_parameters`` or ``_buffers`` dict, and a key in it.
_Place = tuple[dict[str, Tensor | None], str]


class Swapped:
    """``model``'s forward with the tensors a call names swapped in (by their names in
    ``named_parameters()`` / ``named_buffers()``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        places: dict[int, list[_Place]] = {}
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for attr, tensor in store.items():
                    if tensor is not None:
                        places.setdefault(id(tensor), []).append((store, attr))
        named = (*model.named_parameters(), *model.named_buffers())
        #: Every place of each named tensor.
        self.places: dict[str, list[_Place]] = {name: places[id(t)] for name, t in named}

    def __call__(
        self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], *args: object
    ) -> Tensor:
        saved: list[tuple[dict[str, Tensor | None], str, Tensor | None]] = []
        try:
            for tensors in (params, buffers):
                for name, tensor in tensors.items():
                    for store, attr in self._places(name):
                        saved.append((store, attr, store[attr]))
                        store[attr] = tensor
            return self.model(*args)
        finally:
            for store, attr, own in reversed(saved):
                store[attr] = own

    def _places(self, name: str) -> list[_Place]:
        places = self.places.get(name)
        if places is None:
            raise KeyError(
                f"{type(self.model).__name__} has no parameter or buffer {name!r}; the names "
                "are those of its named_parameters() and named_buffers()"
            )
        return places
