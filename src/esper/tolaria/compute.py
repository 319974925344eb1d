"""Training compute: the forward and backward FLOPs each env's training spent in an episode.

A grower is worth having if it reaches a network's accuracy for less training compute
than training that network from the start, so every evaluation row carries the FLOPs
its training took. They are counted from the layers that ran, not from a formula: one
real training step of the host as it stands (``esper.tolaria.epoch.train_step``: the
host's forward and backward, and the incubation pass of a seed in TRAINING) runs on a
copy under torch's ``FlopCounterMode``, which counts every matrix multiplication and
convolution dispatched, forward and backward. Divided by the predictions of that step,
it gives FLOPs per prediction, which is linear in the batch; an epoch's compute is that
times the predictions the env trained on (``EpochResult.train_predictions``).

Counted: training steps. Not counted: the validation passes that feed the controller
(a static network trained alone would run its own), the optimizer's elementwise
update, normalisation and activation layers (FlopCounterMode counts matmul-like ops;
they dominate). The count only changes when a slot's stage or seed changes, so it is
taken once per such state and kept.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from esper.kasmina.growing_host import GrowingHost
from esper.tolaria.epoch import train_step

#: Samples in the probe step: two, since batch norm in training needs more than one
#: value per channel (the 1x1 maps of a CNN's last stage have one per sample).
PROBE_SAMPLES = 2


class TrainingCompute:
    """FLOPs per prediction of each host state, measured once and kept.

    Args:
        example: ``(x, y)`` of at least :data:`PROBE_SAMPLES` training samples on the
            CPU; the probe step runs on their first rows, moved to each host's device.
    """

    def __init__(self, example: tuple[Tensor, Tensor]) -> None:
        x, y = example
        if x.shape[0] < PROBE_SAMPLES:
            raise ValueError(
                f"the compute probe needs at least {PROBE_SAMPLES} samples, got {x.shape[0]}"
            )
        self._x, self._y = x[:PROBE_SAMPLES], y[:PROBE_SAMPLES]
        self._per_prediction: dict[Hashable, float] = {}

    def per_prediction(self, host: GrowingHost) -> float:
        """Forward and backward FLOPs of one training prediction of ``host`` as it is now."""
        key = _state_key(host)
        if key not in self._per_prediction:
            self._per_prediction[key] = self._measure(host)
        return self._per_prediction[key]

    def epoch_flops(
        self, per_prediction: Sequence[float], predictions: Sequence[int]
    ) -> list[float]:
        """Each env's FLOPs over an epoch from its per-prediction cost and predictions."""
        return [f * n for f, n in zip(per_prediction, predictions, strict=True)]

    def _measure(self, host: GrowingHost) -> float:
        probe = copy.deepcopy(host)  # the step changes weights, momenta and BN statistics
        x, y = self._x.to(probe.device), self._y.to(probe.device)
        counter = FlopCounterMode(display=False)
        with counter:
            train_step(probe, x, y)
        return counter.get_total_flops() / y.numel()


def _state_key(host: GrowingHost) -> Hashable:
    """What decides a training step's compute: the host family and size, and each slot's
    stage and seed (blueprint, gated or not). Alpha only scales an output."""
    model = host.model
    slots = tuple(
        (slot.stage, slot.lifecycle.blueprint, slot.gate is not None) for slot in model.iter_slots()
    )
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    return (type(model), shapes, slots)
