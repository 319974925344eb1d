"""Checks a run's whole configuration when it starts, and names each bad value by its CLI key.

Each config dataclass checks its own fields when it is built (``PPOConfig.clip_coef must be
> 0``), so a value that is wrong on its own fails at once. What only the whole run can
check lives here, in :func:`validate_run`, called at the start of ``PPOModule.setup``
when the data module and the number of ranks are known: ``model.n_envs`` split across the
ranks, the data's batches large enough for every env, the host buildable for the data
with the given ``model.host_kwargs``, the blueprints fitting the host's slots.

Every failure is one :class:`ConfigError` whose message starts with the key as the user
typed it (``model.ppo.clip_coef``, ``data.batch_size``) and says which values are allowed.
:func:`config_error_from` turns the error a config class raised while the CLI built it
into the same form, so ``esper fit`` can report it by key instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from esper.kasmina import BLUEPRINTS, HOSTS, HostModel, LifecycleConfig, OptimConfig, SlotShape
from esper.simic.env_config import EnvConfig
from esper.simic.normalizer import NormalizerConfig
from esper.simic.ppo import PPOConfig
from esper.simic.rewards import REWARDS, RewardConfig
from esper.tamiyo.policy import PolicyConfig
from esper.tolaria.data.base import HostDataModule

if TYPE_CHECKING:
    from esper.simic.module import PPOModule

#: CLI key of each config object ``PPOModule`` takes (its ``__init__`` argument names).
CONFIG_KEYS: dict[type, str] = {
    EnvConfig: "model",
    LifecycleConfig: "model.lifecycle",
    OptimConfig: "model.host_optim",
    RewardConfig: "model.rewards",
    PolicyConfig: "model.policy",
    PPOConfig: "model.ppo",
    NormalizerConfig: "model.normalizer",
}
#: ``EnvConfig`` fields whose ``PPOModule`` argument has another name.
_ENV_FIELD_KEYS = {"optim": "host_optim"}
#: Host constructor arguments that are never ``host_kwargs``: the run passes them itself.
_HOST_RESERVED = frozenset({"self", "lifecycle"})
#: ``<Owner>.<field> rest`` or ``<field> rest``: how config errors start.
_LEADING_NAME = re.compile(
    r"^(?:(?P<owner>[A-Za-z_]\w*)\.)?(?P<field>[A-Za-z_]\w*)(?P<rest>.*)$", re.S
)
_MULTIPLE_VALUES = re.compile(r"multiple values for (?:keyword )?argument '(?P<name>\w+)'")
_UNEXPECTED_KWARG = re.compile(r"unexpected keyword argument '(?P<name>\w+)'")


class ConfigError(ValueError):
    """A configuration value is wrong. ``key`` is its CLI key, e.g. ``model.ppo.clip_coef``.

    The message starts with (or at least contains) the key and says which values are
    allowed, so the user can fix the run without reading a traceback.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message if key in message else f"{key}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable with its key: DDP launchers may carry a rank's exception to the parent.
        return (type(self), (self.key, str(self)))


# --------------------------------------------------------------------------- the run
def validate_run(module: PPOModule, datamodule: object, world_size: int) -> None:
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
    envs_per_rank = _check_n_envs(env.n_envs, world_size)
    if not isinstance(datamodule, HostDataModule):
        raise ConfigError(
            "data",
            f"data must be an esper.tolaria.data.HostDataModule (e.g. --data DigitsDataModule, "
            f"SyntheticImageDataModule, TokenSequenceDataModule, Cifar10DataModule), "
            f"got {type(datamodule).__name__}",
        )
    _check_data(datamodule, envs_per_rank, world_size)
    _check_minibatches(module.ppo_config, envs_per_rank, env.n_envs, world_size)
    _check_reward(env)
    host = _build_host(env, datamodule)
    _check_blueprints(env, host)


def _check_configs(module: PPOModule) -> None:
    """Each config object is of its class and still passes its own field checks."""
    env = module.env_config
    configs: list[tuple[str, object, type]] = [
        ("model.lifecycle", env.lifecycle, LifecycleConfig),
        ("model.host_optim", env.optim, OptimConfig),
        ("model.rewards", env.rewards, RewardConfig),
        ("model.policy", module.policy_config, PolicyConfig),
        ("model.ppo", module.ppo_config, PPOConfig),
        ("model.normalizer", module.normalizer_config, NormalizerConfig),
    ]
    for key, config, cls in configs:
        if not isinstance(config, cls):
            raise ConfigError(
                key, f"{key} must be a {cls.__name__} (or null for the defaults), got {config!r}"
            )
        try:
            # Rebuilding runs __post_init__ again: catches values changed after construction.
            dataclasses.replace(config)  # type: ignore[type-var]
        except (ValueError, TypeError) as exc:
            raise _keyed(exc, key, cls) from exc
    for key, value, minimum, why in (
        ("model.n_envs", env.n_envs, 1, ""),
        (
            "model.episode_epochs",
            env.episode_epochs,
            2,
            " (a decision needs an epoch before and after it)",
        ),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(key, f"{key} must be an int >= {minimum}{why}, got {value!r}")
    final = module.ent_coef_final
    if final is not None and not (_is_real(final) and math.isfinite(final) and final >= 0):
        raise ConfigError(
            "model.ent_coef_final",
            f"model.ent_coef_final must be a finite number >= 0, or null to keep "
            f"model.ppo.ent_coef throughout; got {final!r}",
        )


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
            f"model.n_envs={n_envs} must divide evenly across the {world_size} ranks "
            f"(trainer.devices x trainer.num_nodes); allowed: a multiple of {world_size}, "
            f"nearest {' or '.join(map(str, nearest))}",
        )
    return n_envs // world_size


def _check_data(datamodule: HostDataModule, envs_per_rank: int, world_size: int) -> None:
    name = type(datamodule).__name__
    batch = datamodule.batch_size
    if batch < envs_per_rank:
        where = "" if world_size == 1 else f" on each of the {world_size} ranks"
        raise ConfigError(
            "data.batch_size",
            f"data.batch_size={batch} is smaller than the {envs_per_rank} envs{where}: each "
            f"train batch is split across the envs and every env needs at least one sample; "
            f"allowed: data.batch_size >= {envs_per_rank} (or fewer model.n_envs)",
        )
    try:
        n_train, n_val = datamodule.train_size, datamodule.val_size
    except ValueError as exc:
        if "batch_size" not in str(exc):
            raise
        raise ConfigError("data.batch_size", f"data.batch_size: {exc}") from exc
    if n_train < batch:
        raise ConfigError(
            "data.batch_size",
            f"data.batch_size={batch} is larger than the train split of {name} ({n_train} "
            f"samples), so no full batch is left (the last partial batch is dropped); "
            f"allowed: {envs_per_rank} <= data.batch_size <= {n_train}",
        )
    if n_val < 1:
        raise ConfigError("data", f"data: the validation split of {name} is empty")


def _check_minibatches(ppo: PPOConfig, envs_per_rank: int, n_envs: int, world_size: int) -> None:
    if ppo.n_minibatches > envs_per_rank:
        per_rank = "" if world_size == 1 else f" ({n_envs} / {world_size} ranks)"
        raise ConfigError(
            "model.ppo.n_minibatches",
            f"model.ppo.n_minibatches={ppo.n_minibatches} exceeds the {envs_per_rank} envs per "
            f"rank{per_rank}: minibatches split whole env sequences; "
            f"allowed: 1 <= model.ppo.n_minibatches <= {envs_per_rank}",
        )
    if ppo.paired_envs and envs_per_rank < 2:
        raise ConfigError(
            "model.ppo.paired_envs",
            f"model.ppo.paired_envs=true compares each env with the others of its rank, but a "
            f"rank runs {envs_per_rank} env; set model.n_envs to at least {2 * world_size} "
            "or model.ppo.paired_envs=false",
        )


def _check_reward(env: EnvConfig) -> None:
    if env.reward not in REWARDS:
        raise ConfigError(
            "model.reward",
            f"model.reward={env.reward!r} is not a registered reward family; "
            f"allowed: {list(REWARDS.names())}",
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


def _build_host(env: EnvConfig, datamodule: HostDataModule) -> HostModel:
    if env.host not in HOSTS:
        raise ConfigError(
            "model.host",
            f"model.host={env.host!r} is not a registered host; allowed: {list(HOSTS.names())}",
        )
    cls = HOSTS.get(env.host)
    kwargs = env.host_kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(
            "model.host_kwargs",
            f"model.host_kwargs must map argument names to values, got {kwargs!r}",
        )
    accepted, open_kwargs = _host_params(cls)
    unknown = [k for k in kwargs if k not in accepted]
    if unknown and not open_kwargs:
        key = f"model.host_kwargs.{unknown[0]}"
        raise ConfigError(
            key,
            f"{key} is not an argument of host {env.host!r} ({cls.__name__}); "
            f"allowed keys: {_settable(cls, accepted, datamodule)}",
        )
    try:
        return cls.from_data(
            tuple(datamodule.input_shape),
            datamodule.n_classes,
            lifecycle=env.lifecycle,
            **dict(kwargs),
        )
    except (ValueError, TypeError, KeyError) as exc:
        error = exc
    # Explained outside the handler: CPython reports a repeated keyword argument as a bare
    # KeyError instead of a TypeError when the call happens while an exception is handled.
    raise _host_error(error, env, cls, accepted, datamodule) from error


def _settable(cls: type[HostModel], accepted: list[str], datamodule: HostDataModule) -> list[str]:
    """``accepted`` less the arguments the host takes from the data (only on an error path)."""
    defaults = {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is not p.empty
    }
    out = []
    for name in accepted:
        if name in defaults:
            try:
                cls.from_data(
                    tuple(datamodule.input_shape), datamodule.n_classes, **{name: defaults[name]}
                )
            except TypeError as exc:
                if _MULTIPLE_VALUES.search(str(exc)):
                    continue
            except KeyError as exc:  # the same, when called while an exception is handled
                if exc.args == (name,):
                    continue
            except Exception:  # the data may not suit the host at all: keep the name
                pass
        out.append(name)
    return out


def _host_error(
    exc: Exception,
    env: EnvConfig,
    cls: type[HostModel],
    accepted: list[str],
    datamodule: HostDataModule,
) -> ConfigError:
    text = str(exc)
    taken = _MULTIPLE_VALUES.search(text)
    name = taken.group("name") if taken else None
    if isinstance(exc, KeyError):  # a repeated keyword, called while handling an exception
        name = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(name, str) and name in env.host_kwargs:
        key = f"model.host_kwargs.{name}"
        return ConfigError(
            key,
            f"{key} is set by the run from the {_data_desc(datamodule)}; change the data "
            f"instead; allowed keys: {_settable(cls, accepted, datamodule)}",
        )
    unexpected = _UNEXPECTED_KWARG.search(text)
    if unexpected and unexpected.group("name") in env.host_kwargs:
        key = f"model.host_kwargs.{unexpected.group('name')}"
        return ConfigError(
            key,
            f"{key} is not accepted by host {env.host!r} ({cls.__name__}): {text}; "
            f"allowed keys: {_settable(cls, accepted, datamodule)}",
        )
    match = _LEADING_NAME.match(text)
    if match and match.group("owner") == cls.__name__ and match.group("field") in env.host_kwargs:
        key = f"model.host_kwargs.{match.group('field')}"
        return ConfigError(key, f"{key}{match.group('rest')}")
    if env.host_kwargs and _builds(cls, datamodule, env.lifecycle):
        # The host builds for this data without them: the kwargs are at fault.
        return ConfigError(
            "model.host_kwargs",
            f"model.host_kwargs={dict(env.host_kwargs)!r} do not build host {env.host!r} "
            f"({cls.__name__}) for the {_data_desc(datamodule)}: {text}; "
            f"allowed keys: {_settable(cls, accepted, datamodule)}",
        )
    fitting = [name for name in HOSTS.names() if _builds(HOSTS.get(name), datamodule, None)]
    return ConfigError(
        "model.host",
        f"model.host={env.host!r} cannot be built for the {_data_desc(datamodule)}: {text}; "
        f"hosts that build for this data: {fitting or 'none'} (or choose another --data)",
    )


def _builds(cls: type[HostModel], datamodule: HostDataModule, lifecycle: Any) -> bool:
    try:
        cls.from_data(tuple(datamodule.input_shape), datamodule.n_classes, lifecycle=lifecycle)
    except Exception:
        return False
    return True


# --------------------------------------------------------------------------- blueprints
def _shape_desc(slot_id: str, shape: SlotShape) -> str:
    spatial = "x".join(map(str, shape.spatial))
    return f"{slot_id} ({shape.kind}, {shape.channels} channels, {spatial})"


def _check_blueprints(env: EnvConfig, host: HostModel) -> None:
    shapes = {sid: host.slot(sid).shape for sid in host.slot_ids}
    slots = ", ".join(_shape_desc(sid, sh) for sid, sh in shapes.items())
    fitting = [
        n for n in BLUEPRINTS.names() if any(BLUEPRINTS.get(n).fits(sh) for sh in shapes.values())
    ]
    names = env.blueprints
    if names is not None:
        if isinstance(names, str) or not names:
            raise ConfigError(
                "model.blueprints",
                f"model.blueprints must be a non-empty list of blueprint names, or null for "
                f"all that fit; got {names!r}; blueprints that fit host {env.host!r}: {fitting}",
            )
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        if repeated:
            raise ConfigError(
                "model.blueprints",
                f"model.blueprints names {repeated} more than once; list each blueprint once",
            )
        for name in names:
            if name not in BLUEPRINTS:
                raise ConfigError(
                    "model.blueprints",
                    f"model.blueprints names {name!r}, which is not a registered blueprint; "
                    f"allowed: {list(BLUEPRINTS.names())}",
                )
            bp = BLUEPRINTS.get(name)
            if not any(bp.fits(sh) for sh in shapes.values()):
                reason = bp.why_not(next(iter(shapes.values())))
                raise ConfigError(
                    "model.blueprints",
                    f"model.blueprints names {name!r}, which fits no slot of host "
                    f"{env.host!r} (slots: {slots}): {reason}; blueprints that fit: {fitting}",
                )
    chosen = list(names) if names is not None else fitting
    if not chosen:
        raise ConfigError(
            "model.host",
            f"no registered blueprint fits any slot of host {env.host!r} (slots: {slots}); "
            f"model.host allows {list(HOSTS.names())}, registered blueprints: "
            f"{list(BLUEPRINTS.names())}",
        )
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
            f"model.rewards.param_budget={budget} is below the smallest seed the policy could "
            f"plant ({bp_name!r} in {slot_id}: {smallest} parameters), so no seed could ever "
            f"germinate; allowed: model.rewards.param_budget >= {smallest}",
        )


# --------------------------------------------------------------------------- key names
def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self"}  # type: ignore[misc]


def _keyed(exc: BaseException, prefix: str, owner: type) -> ConfigError:
    """``exc`` raised by ``owner`` (a config class or data module), keyed under ``prefix``."""
    text = str(exc)
    match = _LEADING_NAME.match(text)
    if match and (match.group("owner") in (None, owner.__name__)):
        field = match.group("field")
        if field in _field_names(owner):
            if owner is EnvConfig:
                field = _ENV_FIELD_KEYS.get(field, field)
            key = f"{prefix}.{field}"
            return ConfigError(key, f"{key}{match.group('rest')}")
    return ConfigError(prefix, f"{prefix}: {text}")


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and its causes and contexts, deepest first."""
    seen: list[BaseException] = []
    todo: BaseException | None = exc
    while todo is not None and all(todo is not s for s in seen):
        seen.append(todo)
        todo = todo.__cause__ or todo.__context__
    return reversed(seen)


def _owner_of(exc: BaseException) -> tuple[str, type] | None:
    """The CLI prefix and class of the innermost config object or module that raised ``exc``."""
    from esper.simic.module import PPOModule  # here: module.py imports this module

    frames: list[types.FrameType] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        for cls, prefix in CONFIG_KEYS.items():
            if type(owner) is cls:
                return prefix, cls
        if isinstance(owner, PPOModule):
            return "model", type(owner)
        if isinstance(owner, HostDataModule):
            return "data", type(owner)
    return None


def config_error_from(exc: BaseException) -> ConfigError | None:
    """The :class:`ConfigError` behind an error raised while the CLI built the run's objects.

    LightningCLI builds ``PPOConfig`` and friends, the model and the data module from the
    parsed config; their checks raise ``ValueError("PPOConfig.clip_coef must be > 0 ...")``
    and jsonargparse wraps that in a union error that names neither the key nor the value.
    This finds the original error in the chain and names it by its CLI key
    (``model.ppo.clip_coef must be > 0 ...``). None when no config object raised it.
    """
    for link in exception_chain(exc):
        if isinstance(link, ConfigError):
            return link
    by_name = {cls.__name__: (cls, prefix) for cls, prefix in CONFIG_KEYS.items()}
    for link in exception_chain(exc):
        if not isinstance(link, ValueError | TypeError):
            continue
        found = _owner_of(link)
        if found is not None:
            prefix, cls = found
            return _keyed(link, prefix, cls)
        match = _LEADING_NAME.match(str(link))
        if match and match.group("owner") in by_name:
            cls, prefix = by_name[match.group("owner")]
            return _keyed(link, prefix, cls)
    return None
