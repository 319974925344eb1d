"""The validation half of a host epoch: every env's accuracy and, from the same pass, each
seed's counterfactual (the accuracy with that seed's alpha forced to 0).

Training in ``esper.tolaria.epoch`` is per env and per batch; validation is one forward per
env and batch that forks a replica of the batch at each contributing seed, and the
counterfactual accuracies it yields are what a seed's contribution
(``EpochResult.contribution``) is measured against.
Nothing here reads a tensor's value on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from esper.contracts.stages import CONTRIBUTING_STAGES
from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts.base import HostModel
from esper.kasmina.slot import SeedSlot


@torch.no_grad()
def validate_with_counterfactuals(
    envs: Sequence[GrowingHost], batches: Iterable[tuple[Tensor, Tensor]], device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """``(val_loss [E], val_acc [E], cf_val_acc [E, S])`` on ``device`` from one pass.

    Each batch goes once into every env; the host leaves it as ``1 + K`` stacked replicas
    (:class:`CounterfactualPlan`), so the counterfactual accuracies cost one wider forward
    from the first contributing seed on, rather than ``K`` more passes: layers before it run
    once, as in a plain validation pass. Sums stay on each env's device; only
    device-to-device copies reach ``device``.

    Raises:
        ValueError: ``batches`` yielded no samples, or a host's forward does not visit its
            slots in the order of ``HostModel.slots``.
    """
    plans = [CounterfactualPlan(env.model) for env in envs]
    loss_sums = [torch.zeros(p.replicas, device=e.device) for p, e in zip(plans, envs, strict=True)]
    corrects = [
        torch.zeros(p.replicas, device=e.device, dtype=torch.long)
        for p, e in zip(plans, envs, strict=True)
    ]
    devices = {env.device for env in envs}
    seen = 0
    for env in envs:
        env.model.eval()
    try:
        for x_cpu, y_cpu in batches:
            copies = {
                d: (x_cpu.to(d, non_blocking=True), y_cpu.to(d, non_blocking=True)) for d in devices
            }
            for env, plan, loss_sum, correct in zip(envs, plans, loss_sums, corrects, strict=True):
                x, y = copies[env.device]
                r = plan.replicas
                outputs = env.model(x)
                if outputs.shape[0] != r * x.shape[0]:  # shapes only: no device read
                    raise ValueError(
                        f"{type(env.model).__name__} returned {outputs.shape[0]} rows for a "
                        f"batch of {x.shape[0]} with {r - 1} contributing seeds (expected "
                        f"{r * x.shape[0]}); its forward must visit its slots in the order of "
                        "HostModel.slots"
                    )
                loss_sum.add_(env.model.loss_per_replica(outputs, y, r))
                correct.add_(env.model.correct_per_replica(outputs, y, r))
            seen += y.numel()
    finally:
        for plan in plans:
            plan.clear()
        for env in envs:
            env.model.train()
    if seen == 0:
        raise ValueError("the validation loader yielded no samples; it must not be empty")
    val_loss = torch.stack([s[0].to(device, non_blocking=True) for s in loss_sums]) / seen
    accuracies = [(c / seen).to(device, non_blocking=True) for c in corrects]
    val_acc = torch.stack([a[0] for a in accuracies])
    # Integer indexing makes views: building [E, S] this way needs no index tensor upload.
    cf_acc = torch.stack(
        [
            torch.stack([acc[r] for r in plan.slot_to_replica])
            for acc, plan in zip(accuracies, plans, strict=True)
        ]
    )
    return val_loss, val_acc, cf_acc


def contributing_slots(model: HostModel) -> list[SeedSlot]:
    """The slots whose seed has a counterfactual: in a stage that blends it in."""
    return [s for s in model.iter_slots() if s.has_seed and s.stage in CONTRIBUTING_STAGES]


class CounterfactualPlan:
    """Which replica switches off which slot's seed, for one env's validation pass.

    Replica 0 is the env as it is; replica ``k`` is the env with the ``k``-th contributing
    seed (in forward order) at alpha 0, forked at that seed's slot. ``slot_to_replica[s]``
    picks the replica whose accuracy is slot ``s``'s counterfactual (0 for slots with
    nothing to switch off).
    """

    def __init__(self, model: HostModel) -> None:
        slots = list(model.iter_slots())
        contributing = contributing_slots(model)
        self.replicas = 1 + len(contributing)
        self._slots = contributing
        replica_of = {id(s): k + 1 for k, s in enumerate(contributing)}
        self.slot_to_replica = [replica_of.get(id(s), 0) for s in slots]
        for k, slot in enumerate(contributing):
            slot.set_counterfactual_fork(k + 1)

    def clear(self) -> None:
        for slot in self._slots:
            slot.set_counterfactual_fork(None)
