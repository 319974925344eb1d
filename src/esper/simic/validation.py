"""Checks of a run's configuration that no single config can make alone.

Each config checks its own fields when it is built and raises a
:class:`~esper.contracts.config_errors.ConfigError` naming the field. What only the whole
run can check lives here, in :func:`validate_run`, called at the start of
``PPOModule.setup`` when the data module and the number of ranks are known:
``model.n_envs`` split across the ranks, the data's batches large enough for every env,
the host buildable for the data with the given ``model.host_kwargs``, the blueprints
fitting the host's slots and the seed parameter budget. Every failure is a ConfigError
with the full CLI key (``model.ppo.n_minibatches``) and the allowed values.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import torch

from esper.contracts.config_errors import ConfigError, require_number
from esper.devices import check_usable
from esper.kasmina import BLUEPRINTS, HOSTS, HostModel, LifecycleConfig, OptimConfig, SlotShape
from esper.mdp.env_config import EnvConfig, blueprint_names
from esper.mdp.rewards import RewardConfig
from esper.simic.normalizer import NormalizerConfig
from esper.simic.ppo import PPOConfig
from esper.tamiyo.policy import PolicyConfig
from esper.tolaria.data.base import HostDataModule


class RunConfigs(Protocol):
    """The configs of a run as ``PPOModule`` holds them once built (what is checked)."""

    env_config: EnvConfig
    policy_config: PolicyConfig
    ppo_config: PPOConfig
    normalizer_config: NormalizerConfig
    ent_coef_final: float | None


#: CLI key of each config ``PPOModule`` builds (its ``__init__`` argument names).
CONFIG_KEYS: dict[type, str] = {
    EnvConfig: "model",
    LifecycleConfig: "model.lifecycle",
    OptimConfig: "model.host_optim",
    RewardConfig: "model.rewards",
    PolicyConfig: "model.policy",
    PPOConfig: "model.ppo",
    NormalizerConfig: "model.normalizer",
}
#: CLI key of every data module's arguments.
DATA_KEY = "data"
#: CLI key of the devices the hosts are placed on (``EnvConfig.devices``).
DEVICES_KEY = "model.devices"
#: Host constructor arguments that are never ``host_kwargs``: the run passes them itself.
_HOST_RESERVED = frozenset({"self", "lifecycle"})


def cli_key_of(owner: type) -> str | None:
    """Where a config of class ``owner`` sits on the command line; None if nowhere."""
    if issubclass(owner, HostDataModule):
        return DATA_KEY
    return next((CONFIG_KEYS[cls] for cls in owner.__mro__ if cls in CONFIG_KEYS), None)


def check_ent_coef_final(value: object) -> None:
    """``model.ent_coef_final``: where the entropy coefficient ends, or None to keep it."""
    require_number(
        "model.ent_coef_final", value, at_least=0.0, null="keep model.ppo.ent_coef throughout"
    )


_Config = TypeVar("_Config")


def as_config(cls: type[_Config], value: _Config | Mapping[str, Any] | None) -> _Config:
    """``value`` as a ``cls``: None gives the defaults, a mapping its fields.

    Checkpoints keep nested configs as plain mappings (LightningCLI records them so, and
    ``PPOModule.on_save_checkpoint`` turns dataclasses into mappings so that checkpoints
    load with ``weights_only=True``), so a module rebuilt from one receives mappings.
    """
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        key = CONFIG_KEYS[cls]
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(key, f"has no field(s) {unknown}; its fields are {sorted(known)}")
        return cls(**value)
    return value  # anything else is reported by validate_run with its key


def validate_run(module: RunConfigs, datamodule: object, world_size: int) -> None:
    """Check everything about a run that no single config object can check alone.

    Args:
        module: the ``PPOModule`` about to be set up (its configs already built).
        datamodule: what the trainer got as ``datamodule``; must be a ``HostDataModule``.
        world_size: ranks the run spans (``trainer.world_size``); ``model.n_envs`` is the
            total over all ranks and each rank runs ``n_envs // world_size`` of them.

    Raises:
        ConfigError: the first bad value, named by its CLI key with the allowed values.
    """
    env = module.env_config
    _check_configs(module)
    for device in env.devices or ():  # where the hosts will live: before any is built
        check_usable(torch.device(device), DEVICES_KEY)
    envs_per_rank = _check_n_envs(env.n_envs, world_size)
    if not isinstance(datamodule, HostDataModule):
        raise ConfigError(
            DATA_KEY,
            "must be an esper.tolaria.data.HostDataModule (e.g. --data digits, synthetic, "
            f"tokens or cifar10; `esper plugins` lists them), got {type(datamodule).__name__}",
        )
    _check_data(datamodule, envs_per_rank, world_size)
    _check_minibatches(module.ppo_config, envs_per_rank, env.n_envs, world_size)
    _check_blueprints(env, _build_host(env, datamodule))


#: The trainer's precision key, and the precisions a run takes: 32-true, and bf16-mixed
#: (the PPO update under autocast; the rollout runs outside it).
PRECISION_KEY = "trainer.precision"
PRECISIONS = ("32-true", "bf16-mixed")
#: Why the others are refused; tried on this CPU: a 16-mixed update with a real scaler
#: took no step (gradient norm NaN), bf16-true and 64-true fits failed at update 1.
_SCALED = (
    "its gradient scaler cannot serve the PPO update, which clips gradients before its "
    "fused Adam step unscales them"
)
_TRUE = (
    "a true precision makes its dtype torch's default while the training step runs, so "
    "hosts built then do not match their float32 data"
)
_UNTRIED = "the update and the rollout are tried at these only"


def check_precision(precision: str) -> None:
    """Refuse a trainer precision other than :data:`PRECISIONS`, saying why and which
    work (host training's own precision is ``--model.amp``)."""
    if precision in PRECISIONS:
        return
    if precision.endswith("-true"):
        why = _TRUE
    elif precision in ("16-mixed", "16"):
        why = _SCALED
    else:
        why = _UNTRIED
    raise ConfigError(
        PRECISION_KEY,
        f"is {precision!r}: {why}; use {' or '.join(PRECISIONS)} (host training's "
        "precision is --model.amp)",
    )


def _check_configs(module: RunConfigs) -> None:
    """Each config is of its class and still passes its own checks (a caller may have
    changed a field after it was built)."""
    env = module.env_config
    configs = (
        (env, EnvConfig),
        (env.lifecycle, LifecycleConfig),
        (env.optim, OptimConfig),
        (env.rewards, RewardConfig),
        (module.policy_config, PolicyConfig),
        (module.ppo_config, PPOConfig),
        (module.normalizer_config, NormalizerConfig),
    )
    for config, cls in configs:
        key = CONFIG_KEYS[cls]
        if not isinstance(config, cls):
            raise ConfigError(
                key, f"must be a {cls.__name__} (or null for the defaults), got {config!r}"
            )
        try:
            dataclasses.replace(config)  # type: ignore[type-var]  # runs __post_init__ again
        except ConfigError as exc:
            raise exc.under(key) from exc
    check_ent_coef_final(module.ent_coef_final)


def _check_n_envs(n_envs: int, world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            "trainer.devices",
            f"trainer.devices x trainer.num_nodes must give a world size >= 1, got {world_size!r}",
        )
    if n_envs % world_size:
        lower = n_envs // world_size * world_size
        nearest = [v for v in (lower, lower + world_size) if v >= world_size]
        raise ConfigError(
            "model.n_envs",
            f"{n_envs} envs do not divide evenly across the {world_size} ranks "
            f"(trainer.devices x trainer.num_nodes); allowed: a multiple of {world_size}, "
            f"nearest {' or '.join(map(str, nearest))}",
        )
    return n_envs // world_size


def _check_data(datamodule: HostDataModule, envs_per_rank: int, world_size: int) -> None:
    batch = datamodule.batch_size
    if batch < envs_per_rank:
        where = "" if world_size == 1 else f" on each of the {world_size} ranks"
        raise ConfigError(
            "data.batch_size",
            f"{batch} is smaller than the {envs_per_rank} envs{where}: each train batch is "
            f"split across the envs and every env needs at least one sample; "
            f"allowed: data.batch_size >= {envs_per_rank} (or fewer model.n_envs)",
        )
    # Not the test split, not even its size: a fit must never read it (only evaluation
    # does, through host_test_dataloader), and each data module refuses, when it is built,
    # the arguments that would leave it empty.
    try:
        n_train, n_val = datamodule.train_size, datamodule.val_size
    except ConfigError as exc:  # the data module refused an argument while loading
        if exc.owner is None:
            raise
        raise exc.under(DATA_KEY) from exc
    name = type(datamodule).__name__
    if n_train < batch:
        raise ConfigError(
            "data.batch_size",
            f"{batch} is larger than the train split of {name} ({n_train} samples), so no "
            f"full batch is left (the last partial batch is dropped); "
            f"allowed: {envs_per_rank} <= data.batch_size <= {n_train}",
        )
    if n_val < 1:
        raise ConfigError(DATA_KEY, f"the validation split of {name} is empty")


def _check_minibatches(ppo: PPOConfig, envs_per_rank: int, n_envs: int, world_size: int) -> None:
    if ppo.n_minibatches > envs_per_rank:
        per_rank = "" if world_size == 1 else f" ({n_envs} / {world_size} ranks)"
        raise ConfigError(
            "model.ppo.n_minibatches",
            f"{ppo.n_minibatches} exceeds the {envs_per_rank} envs per rank{per_rank}: "
            f"minibatches split whole env sequences; "
            f"allowed: 1 <= model.ppo.n_minibatches <= {envs_per_rank}",
        )
    if ppo.paired_envs and envs_per_rank < 2:
        raise ConfigError(
            "model.ppo.paired_envs",
            f"true compares each env with the others of its rank, but a rank runs "
            f"{envs_per_rank} env; set model.n_envs to at least {2 * world_size} "
            "or model.ppo.paired_envs=false",
        )
    size = ppo.pair_size
    if ppo.paired_envs and size is not None and envs_per_rank > size and envs_per_rank % size:
        per_rank = "" if world_size == 1 else f" ({n_envs} / {world_size} ranks)"
        raise ConfigError(
            "model.ppo.pair_size",
            f"{size} does not divide the {envs_per_rank} envs per rank{per_rank}: "
            f"paired groups are whole; set model.n_envs to a multiple of {size * world_size}, "
            f"or model.ppo.pair_size to a divisor of {envs_per_rank} (null: one group)",
        )


# --------------------------------------------------------------------------- host
def _host_params(cls: type[HostModel]) -> tuple[list[str], bool]:
    """The constructor's keyword names (less ``lifecycle``) and whether it takes ``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters.values()
    names = [
        p.name
        for p in params
        if p.name not in _HOST_RESERVED and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _data_desc(datamodule: HostDataModule) -> str:
    return (
        f"data {type(datamodule).__name__} (input_shape {tuple(datamodule.input_shape)}, "
        f"n_classes {datamodule.n_classes})"
    )


def _from_data(
    cls: type[HostModel], datamodule: HostDataModule, lifecycle: Any, kwargs: Mapping[str, Any]
) -> HostModel:
    return cls.from_data(
        tuple(datamodule.input_shape), datamodule.n_classes, lifecycle=lifecycle, **kwargs
    )


def _builds(
    cls: type[HostModel], datamodule: HostDataModule, lifecycle: Any, kwargs: Mapping[str, Any]
) -> bool:
    try:
        _from_data(cls, datamodule, lifecycle, kwargs)
    except Exception:  # whatever the host refuses with: this only asks whether it builds
        return False
    return True


def _build_host(env: EnvConfig, datamodule: HostDataModule) -> HostModel:
    cls = HOSTS.get(env.host)  # registered: EnvConfig checked the name
    kwargs = env.host_kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("model.host_kwargs", f"must map argument names to values, got {kwargs!r}")
    accepted, open_kwargs = _host_params(cls)
    unknown = [k for k in kwargs if k not in accepted]
    if unknown and not open_kwargs:
        raise ConfigError(
            f"model.host_kwargs.{unknown[0]}",
            f"is not an argument of host {env.host!r} ({cls.__name__}); "
            f"allowed keys: {_settable(cls, accepted, datamodule)}",
        )
    try:
        return _from_data(cls, datamodule, env.lifecycle, kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        raise _host_error(exc, env, cls, accepted, datamodule) from exc


def _settable(cls: type[HostModel], accepted: list[str], datamodule: HostDataModule) -> list[str]:
    """``accepted`` less the arguments the host takes from the data.

    Passing one of those, even at its own default, fails where the bare host builds; the
    others build at their defaults. When the bare host does not build, all are kept.
    """
    if not _builds(cls, datamodule, None, {}):
        return accepted
    params = inspect.signature(cls.__init__).parameters
    return [
        name
        for name in accepted
        if params[name].default is params[name].empty
        or _builds(cls, datamodule, None, {name: params[name].default})
    ]


def _host_error(
    exc: Exception,
    env: EnvConfig,
    cls: type[HostModel],
    accepted: list[str],
    datamodule: HostDataModule,
) -> ConfigError:
    """The key to blame for a host that did not build: tried, not read from the message."""
    kwargs = dict(env.host_kwargs)
    settable = _settable(cls, accepted, datamodule)
    from_data = [k for k in kwargs if k in accepted and k not in settable]
    if from_data:
        return ConfigError(
            f"model.host_kwargs.{from_data[0]}",
            f"is set by the run from the {_data_desc(datamodule)}; change the data "
            f"instead; allowed keys: {settable}",
        )
    # The one argument without which the host builds is the one at fault.
    culprits = [
        k
        for k in kwargs
        if _builds(cls, datamodule, env.lifecycle, {n: v for n, v in kwargs.items() if n != k})
    ]
    if len(culprits) == 1:
        return ConfigError(
            f"model.host_kwargs.{culprits[0]}", f"refused by host {env.host!r}: {exc}"
        )
    if kwargs and _builds(cls, datamodule, env.lifecycle, {}):
        return ConfigError(
            "model.host_kwargs",
            f"{kwargs!r} do not build host {env.host!r} ({cls.__name__}) together for the "
            f"{_data_desc(datamodule)}: {exc}; allowed keys: {settable}",
        )
    fitting = [n for n in HOSTS.names() if _builds(HOSTS.get(n), datamodule, None, {})]
    return ConfigError(
        "model.host",
        f"{env.host!r} cannot be built for the {_data_desc(datamodule)}: {exc}; "
        f"hosts that build for this data: {fitting or 'none'} (or choose another --data)",
    )


# --------------------------------------------------------------------------- blueprints
def _shape_desc(slot_id: str, shape: SlotShape) -> str:
    spatial = "x".join(map(str, shape.spatial))
    return f"{slot_id} ({shape.kind}, {shape.channels} channels, {spatial})"


def _check_blueprints(env: EnvConfig, host: HostModel) -> None:
    """The named blueprints (registered: EnvConfig checked) fit the host, and the
    smallest seed the policy could plant fits the parameter budget."""
    shapes = {sid: host.slot(sid).shape for sid in host.slot_ids}
    slots = ", ".join(_shape_desc(sid, sh) for sid, sh in shapes.items())
    fitting = [
        n for n in BLUEPRINTS.names() if any(BLUEPRINTS.get(n).fits(sh) for sh in shapes.values())
    ]
    for name in env.blueprints or ():
        if name not in fitting:
            reason = BLUEPRINTS.get(name).why_not(next(iter(shapes.values())))
            raise ConfigError(
                "model.blueprints",
                f"names {name!r}, which fits no slot of host {env.host!r} (slots: {slots}): "
                f"{reason}; blueprints that fit: {fitting}",
            )
    if not fitting:
        raise ConfigError(
            "model.host",
            f"no registered blueprint fits any slot of host {env.host!r} (slots: {slots}); "
            f"model.host allows {list(HOSTS.names())}, registered blueprints: "
            f"{list(BLUEPRINTS.names())}",
        )
    chosen = blueprint_names(env, host)
    budget = env.rewards.param_budget
    sizes = [
        (BLUEPRINTS.get(n).param_count(sh), n, sid)
        for n in chosen
        for sid, sh in shapes.items()
        if BLUEPRINTS.get(n).fits(sh)
    ]
    smallest, bp_name, slot_id = min(sizes)
    if smallest > budget:
        raise ConfigError(
            "model.rewards.param_budget",
            f"{budget} is below the smallest seed the policy could plant ({bp_name!r} in "
            f"{slot_id}: {smallest} parameters), so no seed could ever germinate; "
            f"allowed: model.rewards.param_budget >= {smallest}",
        )
