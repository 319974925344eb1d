"""What an env run is: its config (hosts, episode length, seeds, reward family) and the
host and action space that config gives on a data module.

Kept apart from the env itself so that validation, evaluation and the CLI can read a
run's configuration and action space without importing the stepping machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from esper.contracts import ActionSchema
from esper.contracts.config_errors import (
    ConfigError,
    owned_by,
    require_choice,
    require_int,
)
from esper.devices import parse_device
from esper.kasmina import BLUEPRINTS, HOSTS, HostModel, LifecycleConfig, OptimConfig
from esper.kasmina.widen_init import WIDEN_INITS
from esper.mdp.pairing import UNPAIRED, Pairing
from esper.mdp.rewards import REWARDS, RewardConfig
from esper.tolaria.data.base import HostDataModule
from esper.tolaria.host_training import HostTraining, check_host_training


@dataclass(frozen=True)
class EnvConfig:
    """How many hosts, how long an episode, which host, seeds and reward family.

    ``episode_epochs`` counts host epochs per episode; the policy decides after each one
    except the last, so an episode holds ``episode_epochs - 1`` transitions.
    """

    n_envs: int = 4
    episode_epochs: int = 25
    host: str = "cnn"
    host_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Blueprints the policy may plant; None means the host's ``default_blueprints`` (the
    #: widening on the CNN host), or every registered one that fits a slot.
    blueprints: tuple[str, ...] | None = None
    reward: str = "shaped"
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    #: An env that runs out of device memory: "raise" stops the run (after its last
    #: checkpoint), "skip_env_epoch" lets that env sit out the rest of the epoch.
    on_oom: str = "raise"
    #: Run each host's forward and loss through torch.compile.
    compile: bool = False
    #: Mixed precision for host training: "off", "bf16" or "fp16" (one GradScaler per device).
    amp: str = "off"
    #: Devices to place hosts on, round-robin (e.g. ["cuda:0", "cuda:1"]); None: the
    #: module's device.
    devices: tuple[str, ...] | None = None
    #: Which envs start an episode from the same host and train on the same samples
    #: (``esper.mdp.pairing``): training sets it from ``PPOConfig.pairing``; evaluation
    #: keeps it off, so its episodes are independent.
    pairing: Pairing = UNPAIRED
    #: How a widening seed's new units start (``esper.kasmina.widen_init``): "random"
    #: keeps a germination's draw, "gradient" keeps the candidates the loss most needs.
    widen_init: str = "random"
    #: Threads that train CPU envs at once, each env's ops on one core: None uses every
    #: core torch uses (``OMP_NUM_THREADS``), at most one per env; 1 trains envs in turn.
    #: Results are the same either way; GPUs keep their per-env streams.
    cpu_workers: int | None = None
    #: How hosts train: "per_env" (each on its own) or "stacked" (envs whose hosts share
    #: an architecture, seeds agreeing where two have one, as one network mapped over them:
    #: ``esper.tolaria.stacked``). Results agree up to float rounding. "auto": stacked
    #: where every host is on a GPU, per_env elsewhere (``ENGINE_CHOICES``).
    engine: str = "auto"
    #: On a GPU each stacked group, and each env training on its own, records its step as
    #: a CUDA graph once an epoch and replays it (``esper.tolaria.step_graph``). Results
    #: are unchanged.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        with owned_by(self):
            if not isinstance(self.pairing, Pairing):
                raise ConfigError(
                    "pairing", f"must be an esper.mdp.pairing.Pairing, got {self.pairing!r}"
                )
            require_choice("widen_init", self.widen_init, WIDEN_INITS)
            check_host_training(self)
            if self.devices is not None and not self.devices:
                raise ConfigError("devices", "is empty; pass null to use the module's device")
            for device in self.devices or ():
                parse_device(device, "devices", " (or null: the module's device)")
            require_int("n_envs", self.n_envs, 1)
            require_int(
                "episode_epochs",
                self.episode_epochs,
                2,
                hint="one decision needs an epoch before and after it",
            )
            require_choice("host", self.host, HOSTS.names(), "registered hosts")
            require_choice("reward", self.reward, REWARDS.names(), "registered reward families")
            if self.blueprints is not None:
                self._check_blueprints(self.blueprints)
            try:
                self.pairing.group(self.n_envs)
            except ValueError as exc:
                raise ConfigError("pairing", str(exc)) from None

    @property
    def host_training(self) -> HostTraining:
        """How this env group's hosts train each epoch (what ``run_epoch`` takes)."""
        return HostTraining(
            on_oom=self.on_oom,
            compile=self.compile,
            amp=self.amp,
            paired_group=self.paired_group,
            cpu_workers=self.cpu_workers,
            engine=self.engine,
            cuda_graphs=self.cuda_graphs,
        )

    @property
    def paired_group(self) -> int | None:
        """Envs per paired group (they share a host and a data share), None if unpaired."""
        return self.pairing.group(self.n_envs)

    @staticmethod
    def _check_blueprints(names: tuple[str, ...]) -> None:
        if isinstance(names, str) or not names:
            raise ConfigError(
                "blueprints",
                f"must be a non-empty list of blueprint names, or null for the host's own "
                f"list (else all that fit a slot); got {names!r}",
            )
        unknown = [n for n in names if n not in BLUEPRINTS]
        if unknown:
            raise ConfigError(
                "blueprints",
                f"names unknown blueprints {unknown}; allowed: {list(BLUEPRINTS.names())}",
            )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError("blueprints", f"names {repeated} more than once; list each once")


def build_host(config: EnvConfig, datamodule: HostDataModule) -> HostModel:
    """A fresh host sized for the data (input shape, classes or vocabulary)."""
    cls = HOSTS.get(config.host)
    return cls.from_data(
        datamodule.input_shape,
        datamodule.n_classes,
        lifecycle=config.lifecycle,
        **dict(config.host_kwargs),
    )


def blueprint_names(config: EnvConfig, host: HostModel) -> tuple[str, ...]:
    """The blueprints the policy chooses among: the configured ones, else the host's
    ``default_blueprints`` that are registered and fit one of its slots, else every
    registered blueprint that fits one."""
    if config.blueprints:
        return tuple(config.blueprints)
    shapes = [host.slot(s).shape for s in host.slot_ids]

    def fits(name: str) -> bool:
        return name in BLUEPRINTS and any(BLUEPRINTS.get(name).fits(sh) for sh in shapes)

    defaults = tuple(n for n in (host.default_blueprints or ()) if fits(n))
    names = defaults or tuple(n for n in BLUEPRINTS.names() if fits(n))
    if not names:
        raise ValueError(f"no registered blueprint fits any slot of host {config.host!r}")
    return names


def action_schema(config: EnvConfig, datamodule: HostDataModule) -> ActionSchema:
    """The action space a run of ``config`` on ``datamodule`` has, without building the env.

    It depends on the blueprint registry as it is now, so a plugin installed since a
    checkpoint was written can change it; the CLI compares it with a checkpoint's before
    a resumed run starts.
    """
    probe = build_host(config, datamodule)
    return ActionSchema(probe.slot_ids, blueprint_names(config, probe))
