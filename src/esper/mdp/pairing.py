"""Paired envs: which envs of a rank start from one host and train on the same samples.

Envs paired so differ only by what the policy did and by their seeds' own initial draws
(common random numbers; sharing those draws too learned worse policies,
benchmarks/README.md), which is what lets PPO take each env's advantage against the
others of its group (``esper.simic.advantages.leave_one_out``). A rank's envs may form
several groups: consecutive envs, ``pair_size`` each, every group from its own host and
each host trained on ``1 / pair_size`` of every batch.

This is the one definition: training sets it through ``PPOConfig.paired_envs`` and
``PPOConfig.pair_size`` (:attr:`PPOConfig.pairing`), the env runs it
(``EnvConfig.pairing``), and evaluation keeps it off, so its episodes are independent.
"""

from __future__ import annotations

from dataclasses import dataclass

from esper.contracts.config_errors import owned_by, require_bool, require_int


def group_size(n_envs: int, pair_size: int | None) -> int:
    """Envs per paired group among ``n_envs``: ``pair_size``, or all of them when there
    are no more than ``pair_size`` (or ``pair_size`` is None)."""
    if pair_size is None or n_envs <= pair_size:
        return n_envs
    if n_envs % pair_size:
        raise ValueError(
            f"{n_envs} envs do not split into groups of pair_size={pair_size}; make the "
            "envs per rank a multiple of pair_size, or set pair_size to null for one group"
        )
    return pair_size


def check_pairing(paired_envs: object, pair_size: object) -> None:
    """The checks of the two pairing fields, for whichever config holds them."""
    require_bool("paired_envs", paired_envs)
    if pair_size is not None:
        require_int("pair_size", pair_size, 2, hint="or null for one group")


@dataclass(frozen=True)
class Pairing:
    """Whether envs are paired, and into groups of how many (None: all envs one group)."""

    paired_envs: bool = False
    pair_size: int | None = None

    def __post_init__(self) -> None:
        with owned_by(self):
            check_pairing(self.paired_envs, self.pair_size)

    def group(self, n_envs: int) -> int | None:
        """Envs per paired group among ``n_envs`` (they share a host and a data share);
        None if unpaired."""
        return group_size(n_envs, self.pair_size) if self.paired_envs else None


#: No pairing: every env draws its own host and its own share of the data.
UNPAIRED = Pairing()
