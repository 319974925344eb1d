"""Where each feature sits in the observation vector.

The policy sees one flat vector per env. Naming its slices here lets the feature
builder (tamiyo), the normaliser (simic) and telemetry agree on positions without
magic indices.
"""

from __future__ import annotations

from dataclasses import dataclass

from esper.contracts.stages import SeedStage

#: Per-env features that describe the host as a whole, in order.
GLOBAL_FEATURES: tuple[str, ...] = (
    "epoch_fraction",  # host epoch / episode length
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "val_acc_delta",  # change since the previous epoch
    "best_val_acc",
    "params_ratio",  # seed parameters added / param budget
)

#: Per-slot scalar features, in order; the stage and blueprint one-hots follow them.
SLOT_SCALAR_FEATURES: tuple[str, ...] = (
    "epochs_in_stage",
    "alpha",
    "contribution",  # val_acc - counterfactual val_acc with this seed's alpha at 0
    "gate_refused",  # 1 if the last ADVANCE on this slot was refused by a gate
)


@dataclass(frozen=True)
class FeatureSlice:
    name: str
    start: int
    stop: int

    @property
    def width(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ObservationLayout:
    """Named slices of the flat observation for ``n_slots`` slots and ``n_blueprints`` blueprints."""

    n_slots: int
    n_blueprints: int

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"ObservationLayout.n_slots must be >= 1, got {self.n_slots}")
        if self.n_blueprints < 1:
            raise ValueError(
                f"ObservationLayout.n_blueprints must be >= 1, got {self.n_blueprints}"
            )

    @property
    def slices(self) -> tuple[FeatureSlice, ...]:
        out: list[FeatureSlice] = []
        pos = 0

        def add(name: str, width: int) -> None:
            nonlocal pos
            out.append(FeatureSlice(name, pos, pos + width))
            pos += width

        for name in GLOBAL_FEATURES:
            add(name, 1)
        for slot in range(self.n_slots):
            for name in SLOT_SCALAR_FEATURES:
                add(f"slot{slot}.{name}", 1)
            add(f"slot{slot}.stage", len(SeedStage))
            add(f"slot{slot}.blueprint", self.n_blueprints)
        return tuple(out)

    @property
    def slot_width(self) -> int:
        return len(SLOT_SCALAR_FEATURES) + len(SeedStage) + self.n_blueprints

    @property
    def dim(self) -> int:
        return len(GLOBAL_FEATURES) + self.n_slots * self.slot_width

    def __getitem__(self, name: str) -> FeatureSlice:
        for feature in self.slices:
            if feature.name == name:
                return feature
        raise KeyError(f"no observation feature named {name!r}")
