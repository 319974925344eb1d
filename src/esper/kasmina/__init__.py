"""Hosts, seed slots, the lifecycle state machine, blending and the blueprint registry."""

from esper.kasmina.blueprints import BLUEPRINTS, Blueprint, BlueprintFitError, SlotShape
from esper.kasmina.growing_host import GrowingHost
from esper.kasmina.hosts import HOSTS, CNNHost, HostModel, TransformerHost
from esper.kasmina.lifecycle import GateResult, GateSignals, LifecycleConfig, SeedLifecycle
from esper.kasmina.optim import OptimConfig
from esper.kasmina.slot import SeedSlot

__all__ = [
    "BLUEPRINTS",
    "HOSTS",
    "Blueprint",
    "BlueprintFitError",
    "CNNHost",
    "GateResult",
    "GateSignals",
    "GrowingHost",
    "HostModel",
    "LifecycleConfig",
    "OptimConfig",
    "SeedLifecycle",
    "SeedSlot",
    "SlotShape",
    "TransformerHost",
]
