"""Count the host reads of every rollout a real ``PPOModule`` collects during a fit."""

from __future__ import annotations

from dataclasses import dataclass, field

from esper.contracts.rollout import RolloutSummary
from esper.host_reads import HostReadCounter
from esper.simic.module import PPOModule


@dataclass
class RolloutReads:
    """Per rollout: host reads counted around it, what it reported, and where reads came from."""

    reads: list[int] = field(default_factory=list)
    summaries: list[RolloutSummary] = field(default_factory=list)
    reports: list[str] = field(default_factory=list)


def count_rollout_reads(module: PPOModule) -> RolloutReads:
    """Run each of ``module``'s rollouts, callback hooks included, under a HostReadCounter."""
    counted = RolloutReads()
    collect = module._collect

    def collect_counted() -> RolloutSummary:
        with HostReadCounter() as counter:
            summary = collect()
        counted.reads.append(counter.count)
        counted.summaries.append(summary)
        counted.reports.append(counter.report())
        return summary

    module._collect = collect_counted  # type: ignore[method-assign]
    return counted
