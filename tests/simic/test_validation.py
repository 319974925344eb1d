"""Run validation: every bad value is one ConfigError naming its CLI key and what is allowed."""

from __future__ import annotations

import inspect
import pickle
import typing
from pathlib import Path
from typing import Any

import pytest

from esper.cli import main
from esper.cli.bad_input import placed
from esper.contracts.config_errors import ConfigError
from esper.kasmina import LifecycleConfig, OptimConfig
from esper.mdp.env_config import EnvConfig
from esper.mdp.rewards import RewardConfig
from esper.simic.module import PPOModule
from esper.simic.normalizer import NormalizerConfig
from esper.simic.ppo import PPOConfig
from esper.simic.validation import CONFIG_KEYS, cli_key_of, validate_run
from esper.tamiyo.policy import PolicyConfig
from esper.tolaria.data import SyntheticImageDataModule, TokenSequenceDataModule

SMALL_HOST = {"channels": [4, 8]}


def small_data(**kwargs: Any) -> SyntheticImageDataModule:
    return SyntheticImageDataModule(**{"n_train": 64, "n_val": 32, "batch_size": 16, **kwargs})


def small_module(**kwargs: Any) -> PPOModule:
    return PPOModule(**{"n_envs": 4, "episode_epochs": 3, "host_kwargs": SMALL_HOST, **kwargs})


def expect(
    key: str, *allowed: str, module: PPOModule | None = None, data: Any = None, world: int = 1
) -> ConfigError:
    """``validate_run`` fails with one ConfigError for ``key`` whose message shows ``allowed``."""
    with pytest.raises(ConfigError) as info:
        validate_run(module or small_module(), small_data() if data is None else data, world)
    error = info.value
    assert error.key == key and error.owner is None, str(error)
    assert str(error).startswith(f"{key}: "), str(error)
    for text in allowed:
        assert text in str(error), f"{text!r} missing from: {error}"
    return error


def force(config: object, **values: object) -> None:
    """Set fields of a frozen config as a buggy caller could, after its own checks ran."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


def test_a_good_run_passes() -> None:
    validate_run(small_module(), small_data(), 1)
    validate_run(small_module(n_envs=4), small_data(), 2)
    validate_run(
        small_module(host="transformer", host_kwargs={"d_model": 16, "n_layers": 1}),
        TokenSequenceDataModule(n_train=32, n_val=8, batch_size=8),
        1,
    )


def test_config_keys_follow_the_module_arguments() -> None:
    hints = typing.get_type_hints(PPOModule.__init__)
    for cls, key in CONFIG_KEYS.items():
        if cls is EnvConfig:
            continue
        param = key.removeprefix("model.")
        assert param in inspect.signature(PPOModule.__init__).parameters, key
        assert cls in typing.get_args(hints[param]), f"{key} is not a {cls.__name__}"


# ----------------------------------------------------------------- key families
def test_model_top_level_keys() -> None:
    module = small_module()
    force(module.env_config, episode_epochs=1)
    expect("model.episode_epochs", ">= 2", "got 1", module=module)

    module = small_module()
    module.ent_coef_final = -0.5
    expect("model.ent_coef_final", ">= 0", "null", module=module)

    with pytest.raises(ConfigError) as info:
        small_module(n_envs=0)
    assert (info.value.owner, info.value.key) == (EnvConfig, "n_envs")
    assert str(placed(info.value)) == "model.n_envs: must be an int >= 1, got 0"

    with pytest.raises(ConfigError) as info:
        small_module(ent_coef_final=-1.0)
    assert str(info.value).startswith("model.ent_coef_final: must be a finite number >= 0")


# (config attribute path on the module, field, bad value, CLI key, allowed values shown)
DATACLASS_CASES = [
    ("env_config.lifecycle", LifecycleConfig, "blend_epochs", 0, "model.lifecycle", ">= 1"),
    (
        "env_config.lifecycle",
        LifecycleConfig,
        "min_contribution",
        float("nan"),
        "model.lifecycle",
        "finite",
    ),
    ("env_config.optim", OptimConfig, "momentum", 1.5, "model.host_optim", "in [0, 1)"),
    ("env_config.optim", OptimConfig, "host_lr", 0.0, "model.host_optim", "> 0"),
    ("env_config.rewards", RewardConfig, "param_budget", 0, "model.rewards", "int >= 1"),
    ("env_config.rewards", RewardConfig, "wasted_op_penalty", -1.0, "model.rewards", ">= 0"),
    ("policy_config", PolicyConfig, "hidden_size", True, "model.policy", "int >= 1"),
    ("policy_config", PolicyConfig, "value_head_init_gain", 0.0, "model.policy", "> 0"),
    ("ppo_config", PPOConfig, "clip_coef", -1.0, "model.ppo", "> 0"),
    ("ppo_config", PPOConfig, "gamma", 1.5, "model.ppo", "in [0, 1]"),
    ("ppo_config", PPOConfig, "target_kl", 0.0, "model.ppo", "None (null)"),
    ("ppo_config", PPOConfig, "normalize_advantages", 1, "model.ppo", "true or false"),
    ("normalizer_config", NormalizerConfig, "clip", 0.0, "model.normalizer", "> 0"),
]


@pytest.mark.parametrize(
    ("path", "cls", "field", "bad", "prefix", "allowed"),
    DATACLASS_CASES,
    ids=[f"{c[4]}.{c[2]}" for c in DATACLASS_CASES],
)
def test_config_object_keys(
    path: str, cls: type, field: str, bad: object, prefix: str, allowed: str
) -> None:
    key = f"{prefix}.{field}"
    # As the CLI builds it: the class refuses the field, and the CLI puts it under its key.
    with pytest.raises(ConfigError) as info:
        cls(**{field: bad})
    assert (info.value.owner, info.value.key) == (cls, field)
    assert str(info.value).startswith(f"{cls.__name__}.{field}: "), str(info.value)
    assert cli_key_of(cls) == prefix
    error = placed(info.value)
    assert error.key == key and str(error).startswith(f"{key}: ") and allowed in str(error)
    # Set after construction: validate_run catches it when the run starts.
    module = small_module()
    config = module
    for part in path.split("."):
        config = getattr(config, part)
    force(config, **{field: bad})
    expect(key, allowed, module=module)


def test_data_keys() -> None:
    expect("data.batch_size", "data.batch_size >= 32", module=small_module(n_envs=32))
    expect(
        "data.batch_size",
        "data.batch_size >= 4",
        "each of the 2 ranks",
        module=small_module(n_envs=8),
        data=small_data(batch_size=2),
        world=2,
    )
    expect("data.batch_size", "<= 8", data=small_data(n_train=8, batch_size=16))
    with pytest.raises(ConfigError) as info:
        small_data(batch_size=0)
    assert info.value.owner is SyntheticImageDataModule and info.value.key == "batch_size"
    error = placed(info.value)
    assert error.key == "data.batch_size" and ">= 1" in str(error)
    expect("data", "HostDataModule", data=object())


def test_host_and_host_kwargs_keys() -> None:
    module = small_module()
    force(module.env_config, host="resnet")
    expect("model.host", "'cnn'", "'transformer'", module=module)
    expect(
        "model.host",
        "SyntheticImageDataModule",
        "input_shape (1, 8, 8)",
        "hosts that build for this data: ['cnn']",
        module=small_module(host="transformer", host_kwargs={}),
    )
    expect(
        "model.host",
        "TokenSequenceDataModule",
        "['transformer']",
        module=small_module(host_kwargs={}),
        data=TokenSequenceDataModule(n_train=32, n_val=8, batch_size=8),
    )
    expect(
        "model.host_kwargs.chanels",
        "not an argument of host 'cnn'",
        "allowed keys: ['channels', 'convs_per_stage']",
        module=small_module(host_kwargs={"chanels": [4]}),
    )
    expect(
        "model.host_kwargs.channels",
        "positive widths",
        module=small_module(host_kwargs={"channels": [0]}),
    )
    # Of two arguments, the one without which the host builds is named.
    expect(
        "model.host_kwargs.n_heads",
        "refused by host 'transformer'",
        "multiple of n_heads",
        module=small_module(host="transformer", host_kwargs={"n_layers": 1, "n_heads": 5}),
        data=TokenSequenceDataModule(n_train=32, n_val=8, batch_size=8),
    )
    expect(
        "model.host_kwargs.vocab_size",
        "set by the run from the data TokenSequenceDataModule",
        "allowed keys: ['d_model', 'n_heads', 'n_layers', 'mlp_hidden']",
        module=small_module(host="transformer", host_kwargs={"vocab_size": 3}),
        data=TokenSequenceDataModule(n_train=32, n_val=8, batch_size=8),
    )


def test_blueprint_keys() -> None:
    module = small_module()
    force(module.env_config, blueprints=("conv_light", "nope"))
    expect("model.blueprints", "['nope']", "allowed: ['conv_light'", module=module)
    expect(
        "model.blueprints",
        "'conv_light', which fits no slot of host 'transformer'",
        "block0 (transformer, 16 channels, 32)",
        "blueprints that fit: ['attention', 'norm', 'lora', 'mlp', 'widen']",
        module=small_module(
            host="transformer", host_kwargs={"d_model": 16}, blueprints=["norm", "conv_light"]
        ),
        data=TokenSequenceDataModule(n_train=32, n_val=8, batch_size=8),
    )
    module = small_module()
    force(module.env_config, blueprints=("norm", "norm"))
    expect("model.blueprints", "['norm'] more than once", module=module)


def test_reward_name_and_budget_keys() -> None:
    module = small_module()
    force(module.env_config, reward="dense")
    expect("model.reward", "got 'dense'", "['shaped', 'sparse']", module=module)
    expect(
        "model.rewards.param_budget",
        "allowed: model.rewards.param_budget >= ",
        module=small_module(rewards=RewardConfig(param_budget=1)),
    )


def test_n_envs_must_divide_across_ranks() -> None:
    expect(
        "model.n_envs",
        "6 envs",
        "4 ranks",
        "nearest 4 or 8",
        module=small_module(n_envs=6),
        world=4,
    )
    expect("model.n_envs", "a multiple of 4, nearest 4", module=small_module(n_envs=3), world=4)
    expect("trainer.devices", ">= 1", world=0)


def test_n_minibatches_at_most_envs_per_rank() -> None:
    expect(
        "model.ppo.n_minibatches",
        "1 <= model.ppo.n_minibatches <= 2",
        "(4 / 2 ranks)",
        module=small_module(ppo=PPOConfig(n_minibatches=4)),
        world=2,
    )


def test_paired_envs_needs_two_envs_per_rank() -> None:
    expect(
        "model.ppo.paired_envs",
        "a rank runs 1 env",
        "model.n_envs to at least 4",
        module=small_module(n_envs=2, ppo=PPOConfig(n_minibatches=1, paired_envs=True)),
        world=2,
    )


def test_pair_size_must_divide_the_envs_per_rank_and_the_message_names_the_fix() -> None:
    expect(
        "model.ppo.pair_size",
        "does not divide the 6 envs per rank (12 / 2 ranks)",
        "a multiple of 8",
        "(null: one group)",
        module=small_module(n_envs=12, ppo=PPOConfig(pair_size=4)),
        world=2,
    )
    validate_run(small_module(n_envs=8, ppo=PPOConfig(pair_size=4)), small_data(), 1)
    validate_run(
        small_module(
            n_envs=6,
            ppo=PPOConfig(pair_size=4, paired_envs=False, critic_baseline=True, vf_coef=0.5),
        ),
        small_data(),
        1,
    )


def test_a_config_error_keeps_its_key_and_owner_through_pickling() -> None:
    error = pickle.loads(pickle.dumps(ConfigError("clip_coef", "must be > 0", PPOConfig)))
    assert (error.key, error.message, error.owner) == ("clip_coef", "must be > 0", PPOConfig)
    assert str(error) == "PPOConfig.clip_coef: must be > 0"
    assert str(placed(error)) == "model.ppo.clip_coef: must be > 0"


# ----------------------------------------------------------------- as the user sees it
@pytest.fixture
def run_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> typing.Callable[..., str]:
    """``esper fit ARGS`` that must fail; returns the error text the user sees."""
    monkeypatch.setattr("sys.argv", ["esper"])

    def run(*args: str) -> str:
        argv = ["fit", *args, "--trainer.default_root_dir", str(tmp_path)]
        argv += ["--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false"]
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code not in (0, None)
            return capsys.readouterr().err
        pytest.fail(f"esper {' '.join(argv)} accepted a bad config")

    return run


def test_cli_names_a_bad_range_by_its_key(run_fit: typing.Callable[..., str]) -> None:
    err = run_fit("--model.ppo.clip_coef", "-1")
    assert "model.ppo.clip_coef: must be a finite number > 0, got -1.0" in err
    assert "Union" not in err  # not jsonargparse's wrapper


def test_cli_names_a_bad_type_by_its_key(run_fit: typing.Callable[..., str]) -> None:
    err = run_fit("--model.ppo.update_epochs", "true")
    assert err.splitlines() == [
        "esper fit: error: model.ppo.update_epochs: expected an integer, got 'True'"
    ]


def test_cli_names_a_host_that_does_not_fit_the_data(run_fit: typing.Callable[..., str]) -> None:
    err = run_fit("--model.host", "transformer")
    assert "model.host: 'transformer' cannot be built for the data DigitsDataModule" in err
    assert "hosts that build for this data: ['cnn']" in err


def test_a_precision_not_tried_is_refused_naming_those_that_were() -> None:
    from esper.simic.validation import check_precision

    check_precision("32-true")
    check_precision("bf16-mixed")
    with pytest.raises(
        ConfigError, match=r"trainer\.precision: is 'transformer-engine'.*32-true or bf16-mixed"
    ):
        check_precision("transformer-engine")
