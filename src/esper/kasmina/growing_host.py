"""One env's growing network: the host model, its optimizer, and one optimizer per live seed.

The lifecycle ops that change which parameters exist live here, because they must keep
the optimizers in step with the module tree: GERMINATE adds a seed optimizer, FOSSILIZE
moves the seed's parameters into the host optimizer (a widening seed's are merged into
the host's own layers, momentum included), PRUNE drops them both.
"""

from __future__ import annotations

import torch
from torch import nn

from esper.contracts import BlendMode, SeedStage
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.lifecycle import GateResult, GateSignals
from esper.kasmina.optim import BASE_LR_KEY, OptimConfig
from esper.kasmina.sgd import clear_grads, sgd_step
from esper.kasmina.widen_init import WIDEN_INITS, gradient_selected


class GrowingHost:
    """The host network of one env and the optimizers that train it and its seeds."""

    def __init__(
        self, model: HostModel, optim: OptimConfig | None = None, widen_init: str = "random"
    ) -> None:
        if widen_init not in WIDEN_INITS:
            raise ValueError(f"widen_init must be one of {list(WIDEN_INITS)}, got {widen_init!r}")
        self.model = model
        self.optim = optim or OptimConfig()
        #: How a widening seed's units start (``esper.kasmina.widen_init``).
        self.widen_init = widen_init
        #: The last batch the host trained on (set by each training step): what the
        #: gradient-informed start of a widening seed ranks its candidate units on.
        self.probe: tuple[torch.Tensor, torch.Tensor] | None = None
        #: Where the learning-rate schedule stands: every optimizer runs at base * this.
        self.lr_factor = 1.0
        self.host_optimizer = self.optim.make(model.host_parameters(), self.optim.host_lr)
        self.seed_optimizers: dict[str, torch.optim.Optimizer] = {}

    # ----------------------------------------------------------------- queries
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def slot_ids(self) -> tuple[str, ...]:
        return self.model.slot_ids

    def trainable_seed_slots(self) -> list[str]:
        """Slots whose seed is trained by its own optimizer this epoch."""
        return list(self.seed_optimizers)

    # ----------------------------------------------------------- lifecycle ops
    def germinate(self, slot_id: str, blueprint: str, blend_mode: BlendMode) -> nn.Module:
        slot = self.model.slot(slot_id)
        seed = slot.germinate(blueprint, blend_mode)
        if slot.widens and self.widen_init == "gradient" and self.probe is not None:
            # Without a batch trained yet there is nothing to rank on: the draw stays.
            seed = gradient_selected(self.model, slot, *self.probe)
            slot.replace_seed(seed)
        self.seed_optimizers[slot_id] = self.optim.make(
            slot.seed_parameters(), self.optim.seed_lr, self.lr_factor
        )
        return seed

    def advance(self, slot_id: str, signals: GateSignals) -> GateResult:
        slot = self.model.slot(slot_id)
        result = slot.advance(signals)
        if result and slot.stage is SeedStage.FOSSILIZED:
            self._fossilize(slot_id)
        return result

    def _fossilize(self, slot_id: str) -> None:
        """The seed's parameters join the host optimizer; its own optimizer is dropped."""
        slot = self.model.slot(slot_id)
        if slot.widens:
            self.model.merge_widening(slot_id, self.optimizers())
            del self.seed_optimizers[slot_id]
            return
        params = list(slot.seed_parameters())
        del self.seed_optimizers[slot_id]
        base = self.optim.host_lr
        self.host_optimizer.add_param_group(
            {"params": params, "lr": base * self.lr_factor, BASE_LR_KEY: base}
        )

    def prune(self, slot_id: str) -> None:
        self.model.slot(slot_id).prune()
        del self.seed_optimizers[slot_id]

    def end_epoch(self) -> dict[str, SeedStage]:
        """Advance every slot's epoch counter; return stages entered by the cool-down clock."""
        entered: dict[str, SeedStage] = {}
        for slot in self.model.iter_slots():
            stage = slot.end_epoch()
            if stage is not None:
                entered[slot.slot_id] = stage
        return entered

    # ------------------------------------------------------------ training
    def set_progress(self, progress: float) -> None:
        """Set every learning rate for ``progress`` in [0, 1] through the episode."""
        self.lr_factor = self.optim.lr_factor(progress)
        for optimizer in self.optimizers():
            for group in optimizer.param_groups:
                group["lr"] = group[BASE_LR_KEY] * self.lr_factor

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The host's optimizer, then each live seed's."""
        return [self.host_optimizer, *self.seed_optimizers.values()]

    def zero_grad(self) -> None:
        clear_grads(self.optimizers())

    def step(self) -> None:
        """One SGD step of the host and every live seed, as one batch of ops
        (``esper.kasmina.sgd``: the same arithmetic as each optimizer's own ``step``)."""
        sgd_step(self.optimizers())
