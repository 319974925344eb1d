"""Running host epochs for a batch of envs, the host data, and snapshots for rollback."""

from esper.tolaria.epoch import EpochResult, run_epoch
from esper.tolaria.snapshot import HostSnapshot

__all__ = ["EpochResult", "HostSnapshot", "run_epoch"]
