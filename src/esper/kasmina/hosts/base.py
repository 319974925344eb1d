"""What every host network offers the rest of Esper.

A host is an ordinary ``nn.Module`` with named :class:`SeedSlot`s between its stages.
Its parameters split in two: the host's own (plus fossilized seeds), trained by the host
optimizer, and each live seed's, trained by that seed's optimizer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from esper.contracts import SeedStage
from esper.contracts.checks import is_finite_real
from esper.kasmina.lifecycle import LifecycleConfig
from esper.kasmina.slot import SeedSlot
from esper.kasmina.widening import TensorMerge, apply_merges


class HostModel(nn.Module, ABC):
    """Base class for hosts. Subclasses build ``self.slots`` and define the task's loss.

    ``self.slots`` lists the slots in the order ``forward`` passes through them: the
    counterfactual validation pass forks its replicas slot by slot in that order.
    """

    #: The host family, matched against blueprints' ``host_kinds``.
    kind: str = ""
    #: The blueprints this host offers the policy when a run names none
    #: (``EnvConfig.blueprints``); None offers every registered blueprint that fits a slot.
    #: Each name the policy may choose is one more arm whose worth it must learn from
    #: fractions of an accuracy point, so a host family lists the ones that suit it.
    default_blueprints: tuple[str, ...] | None = None
    #: Whether the host's forward is exact on layers zero-padded to a wider size: every op
    #: between its convolutions, norms and linear layers treats channels apart and maps
    #: an all-zero channel to zeros, and nothing in Python reads a layer's width. Then the
    #: stacked engine (``esper.tolaria.stacked``) may train envs whose layers merged
    #: different widenings as one group, each padded with zeros to the group's widest.
    pads_widths_exactly: bool = False
    slots: nn.ModuleDict

    @classmethod
    @abstractmethod
    def from_data(
        cls,
        input_shape: tuple[int, ...],
        n_classes: int,
        lifecycle: LifecycleConfig | None = None,
        **kwargs: Any,
    ) -> HostModel:
        """Build a host sized for a data module's ``input_shape`` and ``n_classes``.

        The trainer builds hosts from data it only knows at run time; each host maps
        those two numbers onto its own constructor (classes, vocabulary, sequence length).
        """

    @classmethod
    def widened_kwargs(cls, kwargs: Mapping[str, Any], factor: float) -> list[dict[str, Any]]:
        """Constructor keyword arguments of this host made about ``factor`` times wider.

        Why: the ``static_equal`` control of ``esper evaluate`` is the plain host family
        widened to a grown network's parameter count
        (:func:`esper.kasmina.sizing.equal_size_host_kwargs`). Only the family knows
        which of its widths can grow and in what steps, so it offers the few integer
        roundings near ``factor`` (``factor >= 1``, see :func:`check_widening_factor`);
        the search builds each and keeps the one whose measured count is closest.
        Arguments that are not widths come back unchanged.
        """
        raise NotImplementedError(
            f"{cls.__name__} has no widened_kwargs; implement widened_kwargs on "
            f"{cls.__name__} to use the static_equal control with this host"
        )

    @property
    def slot_ids(self) -> tuple[str, ...]:
        return tuple(self.slots.keys())

    def slot(self, slot_id: str) -> SeedSlot:
        try:
            return self.slots[slot_id]  # type: ignore[return-value]
        except KeyError:
            raise KeyError(
                f"host has no slot {slot_id!r}; its slots are {list(self.slot_ids)}"
            ) from None

    def iter_slots(self) -> Iterator[SeedSlot]:
        yield from self.slots.values()  # type: ignore[misc]

    def host_parameters(self) -> list[nn.Parameter]:
        """Parameters the host optimizer owns: everything but not-yet-fossilized seeds."""
        seed_ids = {
            id(p)
            for slot in self.iter_slots()
            if slot.stage is not SeedStage.FOSSILIZED
            for p in slot.seed_parameters()
        }
        return [p for p in self.parameters() if id(p) not in seed_ids]

    def seed_param_count(self) -> int:
        """Parameters added by seeds (live and fossilized): what the parameter rent charges."""
        return sum(slot.seed_param_count() for slot in self.iter_slots())

    @contextmanager
    def mapped(self) -> Iterator[None]:
        """Within the block the host runs as ``torch.func.vmap`` maps it over envs
        (``esper.tolaria.stacked``): a host that changes its computation by what it can
        see of a tensor (its memory layout, whether it needs a gradient, which a mapped
        tensor does not report) takes its plain path here, so a mapped step computes what
        the host's own step computes. This host has no such shortcut."""
        yield

    def forward_from_slot(self, index: int, h: Tensor, context: Tensor | None = None) -> Tensor:
        """The rest of ``forward`` from what reaches slot ``index`` (``self.slots`` order):
        ``h`` and the ``context`` the host hands that slot beside it (see ``SeedSlot``).

        Why: a seed in TRAINING learns in a pass of its own (``esper.kasmina.incubation``),
        and the layers before its slot compute there exactly what the host's own forward
        just computed. A host that overrides this lets that pass start at the slot; one
        that does not is run whole, with the same result, a little slower.
        """
        raise NotImplementedError(f"{type(self).__name__} does not resume at a slot")

    def merge_widening(
        self, slot_id: str, optimizers: Iterable[torch.optim.Optimizer] = ()
    ) -> None:
        """Merge the fossilized widening seed of ``slot_id`` into this host's layers, their
        momentum from ``optimizers`` with them; the slot then holds no module.

        The slot keeps counting what the merge added to the host: the seed's parameters
        and the blocks between old and new units that were held at zero while it lived
        (they train from now on), so the rent charges the network the host has become.
        """
        slot = self.slot(slot_id)
        host_before = sum(p.numel() for p in self.parameters()) - slot.seed_param_count()
        apply_merges(self.widening_merges(slot_id), optimizers)
        self.sync_widths()
        host_after = sum(p.numel() for p in self.parameters()) - slot.seed_param_count()
        slot.absorb(host_after - host_before)

    def sync_widths(self) -> None:
        """Make each layer's width attributes (``in_features`` and the like) match its
        weights after a merge. Hosts that widen override it."""

    def widening_merges(self, slot_id: str) -> list[TensorMerge]:
        """How the fossilized widening seed of ``slot_id`` merges into this host's layers.

        Why the host: only it knows which of its layers the seed's units extend (see
        ``esper.kasmina.widening``); :meth:`esper.kasmina.growing_host.GrowingHost.advance`
        applies them when the seed fossilizes.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot merge a widening seed; implement widening_merges "
            "and widened_layers on it, or leave 'widen' out of its blueprints"
        )

    def widened_layers(self, slot_id: str) -> list[nn.Module]:
        """The host's layers a merged widening of ``slot_id`` made wider (to initialise
        afresh when a static control is built with them: ``esper.kasmina.architecture``)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot merge a widening seed; implement widening_merges "
            "and widened_layers on it, or leave 'widen' out of its blueprints"
        )

    @abstractmethod
    def check_input(self, x: Tensor) -> None:
        """Raise ValueError naming the expected and the given shape/dtype. Host-side only."""

    @abstractmethod
    def loss_and_correct(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, int]:
        """Mean loss, number of correct predictions (device tensor) and number of predictions.

        The count is a Python int derived from shapes, so no device value is read.
        """

    def loss_and_correct_per_env(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Each env's mean loss ``[G]`` and correct predictions ``[G]``, as
        :meth:`loss_and_correct` gives them for one env, from G envs' outputs and targets
        stacked ``[G, ...]`` (the stacked engine's: ``esper.tolaria.stacked``).

        Here :meth:`loss_and_correct` mapped over the envs with ``vmap``. A host whose loss
        is a mean cross-entropy over its predictions derives from :class:`CrossEntropyHost`,
        which takes one flat cross-entropy (:func:`mean_cross_entropy_per_env`): under
        ``vmap`` a cross-entropy runs as a Python decomposition of some thirty ops where
        the flat one takes a dozen."""

        def one(out: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
            loss, correct, _ = self.loss_and_correct(out, tgt)
            return loss, correct

        return torch.func.vmap(one)(outputs, targets)

    def correct_per_replica(self, outputs: Tensor, targets: Tensor, replicas: int) -> Tensor:
        """Correct predictions ``[replicas]`` when ``outputs`` stacks ``replicas`` copies of a batch."""
        pred = outputs.argmax(dim=-1).unflatten(0, (replicas, -1))
        return (pred == targets.unsqueeze(0)).flatten(1).sum(dim=1)

    def loss_and_correct_per_replica_per_env(
        self, outputs: Tensor, targets: Tensor, replicas: int
    ) -> tuple[Tensor, Tensor]:
        """:meth:`loss_per_replica` and :meth:`correct_per_replica` of G envs' outputs
        stacked ``[G, ...]`` on one batch's ``targets``, each ``[G, replicas]`` (the
        stacked validation's). Here both mapped over the envs with ``vmap``;
        :class:`CrossEntropyHost` takes one flat cross-entropy
        (:func:`cross_entropy_per_replica_per_env`)."""

        def one(out: Tensor) -> tuple[Tensor, Tensor]:
            return (
                self.loss_per_replica(out, targets, replicas),
                self.correct_per_replica(out, targets, replicas),
            )

        return torch.func.vmap(one)(outputs)

    def loss_per_replica(self, outputs: Tensor, targets: Tensor, replicas: int) -> Tensor:
        """Summed loss ``[replicas]`` over each replica's predictions."""
        logits = outputs.unflatten(0, (replicas, -1))
        tgt = targets.unsqueeze(0).expand(replicas, *targets.shape)
        losses = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
        )
        return losses.view(replicas, -1).sum(dim=1)


class CrossEntropyHost(HostModel):
    """A host whose loss is the mean cross-entropy over its predictions (the CNN and the
    transformer): its stacked engine's per-env sums are one flat cross-entropy, where the
    default maps the host's own methods with ``vmap`` (as a Python decomposition of some
    thirty ops)."""

    def loss_and_correct_per_env(self, outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return mean_cross_entropy_per_env(outputs, targets)

    def loss_and_correct_per_replica_per_env(
        self, outputs: Tensor, targets: Tensor, replicas: int
    ) -> tuple[Tensor, Tensor]:
        return cross_entropy_per_replica_per_env(outputs, targets, replicas)


def cross_entropy_per_replica_per_env(
    outputs: Tensor, targets: Tensor, replicas: int
) -> tuple[Tensor, Tensor]:
    """Per env of ``outputs [G, replicas * b, ..., classes]`` (``replicas`` stacked copies of
    a batch) and per replica: the summed cross-entropy against ``targets [b, ...]`` and the
    correct predictions, each ``[G, replicas]``, as one flat cross-entropy."""
    envs, classes = outputs.shape[0], outputs.shape[-1]
    logits = outputs.reshape(envs, replicas, *targets.shape, classes)
    wanted = targets.expand(envs, replicas, *targets.shape)
    losses = nn.functional.cross_entropy(
        logits.reshape(-1, classes), wanted.reshape(-1), reduction="none"
    )
    correct = (logits.argmax(dim=-1) == wanted).reshape(envs, replicas, -1).sum(dim=2)
    return losses.view(envs, replicas, -1).sum(dim=2), correct


def mean_cross_entropy_per_env(outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per env of ``outputs [G, ..., classes]`` and ``targets [G, ...]``: the mean
    cross-entropy over its predictions ``[G]`` and how many are right ``[G]``, as one
    flat cross-entropy over all of them."""
    envs, classes = outputs.shape[0], outputs.shape[-1]
    losses = nn.functional.cross_entropy(
        outputs.reshape(-1, classes), targets.reshape(-1), reduction="none"
    )
    correct = (outputs.argmax(dim=-1) == targets).reshape(envs, -1).sum(dim=1)
    return losses.view(envs, -1).mean(dim=1), correct


def check_widening_factor(factor: float) -> float:
    """``factor`` as a float, refused unless finite and >= 1.

    Why at least 1: ``static_equal`` matches a grown network, which only ever gained
    parameters; a host narrower than its family's own configuration is no such control.
    """
    if not is_finite_real(factor):
        raise ValueError(f"widening factor must be a finite number >= 1, got {factor!r}")
    if factor < 1:
        raise ValueError(
            f"widening factor must be >= 1, got {factor}; static_equal widens a host, "
            "it cannot shrink one"
        )
    return float(factor)


def integer_roundings(value: float, step: int = 1, minimum: int = 1) -> tuple[int, ...]:
    """The multiples of ``step`` just below and just above ``value``, at least ``minimum``.

    Ascending, without repeats: ``(6, 7)`` for 6.4, ``(8, 12)`` for 10.0 in steps of 4,
    ``(10,)`` for 10.0 in steps of 1. A widening offers both so a parameter search can
    land between the two widths; ``minimum`` keeps a width usable (one channel, one head).
    """
    low = max(minimum, math.floor(value / step) * step)
    high = max(minimum, math.ceil(value / step) * step)
    return (low,) if low == high else (low, high)
