"""Plugin discovery through entry points (plugins/registry.py)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import HOSTS, BlueprintFitError, SeedSlot, SlotShape
from esper.kasmina.blueprints import BLUEPRINTS, Blueprint, blueprints_fitting
from esper.kasmina.blueprints import _as_blueprint as as_blueprint
from esper.plugins import BUILTIN_SOURCE, PluginError, Registered, Registry
from esper.plugins.registry import _distribution_of

GROUP = "esper.blueprints"

PLUGIN_MODULE = """
from esper.kasmina.blueprints import Blueprint
from esper.kasmina.blueprints.layers import channel_linear, zero_


def _build(shape):
    return zero_(channel_linear(shape, shape.channels, shape.channels))


BLUEPRINT = Blueprint(
    "{name}",
    frozenset({{"cnn", "transformer"}}),
    _build,
    lambda s: s.channels**2 + s.channels,
    description="a zero-initialised channel map from a test plugin",
)


def make():
    return BLUEPRINT
"""

TEST_MODULES = ("esper_testplug", "esper_otherplug", "esper_dupplug", "esper_brokenplug")


def write_dist(
    root: Path,
    dist: str,
    module: str,
    entries: dict[str, str],
    source: str,
    group: str = GROUP,
) -> Path:
    """A minimal installed distribution: ``<dist>-0.1.dist-info`` plus one module, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


class PluginPath:
    """Directories put on ``sys.path`` for one test."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def __call__(self, path: Path) -> None:
        sys.path.insert(0, str(path))
        self.added.append(str(path))
        importlib.invalidate_caches()

    def remove(self, path: Path) -> None:
        sys.path.remove(str(path))
        self.added.remove(str(path))
        importlib.invalidate_caches()


@pytest.fixture
def plugin_path() -> Iterator[PluginPath]:
    """Put directories on ``sys.path``; afterwards remove them and reset the global registries."""
    paths = PluginPath()
    yield paths

    for path in paths.added:
        sys.path.remove(path)
    for module in TEST_MODULES:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()
    BLUEPRINTS.reload_entry_points()
    HOSTS.reload_entry_points()
    assert "my_bp" not in BLUEPRINTS


def fresh_blueprints(with_builtins: bool = True) -> Registry[Blueprint]:
    registry: Registry[Blueprint] = Registry(GROUP, "blueprint", validate=as_blueprint)
    if with_builtins:
        for name in ("conv_light", "norm"):
            registry.register(name, BLUEPRINTS.get(name))
    return registry


def make_testplug(tmp_path: Path, entries: dict[str, str] | None = None) -> Path:
    return write_dist(
        tmp_path / "testplug",
        "esper-testplug",
        "esper_testplug",
        entries or {"my_bp": "esper_testplug:BLUEPRINT"},
        PLUGIN_MODULE.format(name="my_bp"),
    )


# ------------------------------------------------------------------ discovery


def test_entry_point_blueprint_is_discovered_and_germinates_in_a_slot(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(make_testplug(tmp_path))

    registry = fresh_blueprints()
    assert "my_bp" in registry
    entry = registry.entry("my_bp")
    assert entry.source == "esper-testplug 0.1"
    assert isinstance(entry.obj, Blueprint)

    BLUEPRINTS.reload_entry_points()
    assert "my_bp" in BLUEPRINTS
    assert BLUEPRINTS.entry("my_bp").source == "esper-testplug 0.1"
    assert BLUEPRINTS.entry("conv_light").source == BUILTIN_SOURCE

    shape = SlotShape("cnn", 8, (4, 4))
    assert "my_bp" in blueprints_fitting(shape)
    slot = SeedSlot("s", shape)
    seed = slot.germinate("my_bp", BlendMode.LINEAR)
    assert slot.stage is SeedStage.GERMINATED
    assert slot.lifecycle.blueprint == "my_bp"
    assert slot.seed_param_count() == 8 * 8 + 8
    with torch.no_grad():
        assert not bool(seed(torch.randn(2, 8, 4, 4)).any())


def test_entry_point_may_name_a_factory_returning_a_blueprint(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(make_testplug(tmp_path, {"my_bp": "esper_testplug:make"}))
    registry = fresh_blueprints()
    assert registry.get("my_bp").name == "my_bp"


def test_entry_points_load_lazily_on_first_lookup(tmp_path: Path, plugin_path: PluginPath) -> None:
    plugin_path(make_testplug(tmp_path))
    registry = fresh_blueprints()
    assert "esper_testplug" not in sys.modules
    registry.names()
    assert "esper_testplug" in sys.modules


def test_entry_points_of_other_groups_are_ignored(tmp_path: Path, plugin_path: PluginPath) -> None:
    plugin_path(
        write_dist(
            tmp_path / "hostplug",
            "esper-testplug",
            "esper_testplug",
            {"my_bp": "esper_testplug:BLUEPRINT"},
            PLUGIN_MODULE.format(name="my_bp"),
            group="esper.hosts",
        )
    )
    assert "my_bp" not in fresh_blueprints()


def test_reload_forgets_plugins_that_are_gone_and_keeps_builtins(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    path = make_testplug(tmp_path)
    plugin_path(path)
    registry = fresh_blueprints()
    assert "my_bp" in registry
    plugin_path.remove(path)
    registry.reload_entry_points()
    assert "my_bp" not in registry
    assert registry.names() == ("conv_light", "norm")


# ------------------------------------------------------------------ errors


def test_duplicate_registration_in_code_names_both_sources() -> None:
    registry = fresh_blueprints()
    other = Blueprint(
        "norm", frozenset({"cnn"}), BLUEPRINTS.get("norm").build, BLUEPRINTS.get("norm").param_count
    )
    with pytest.raises(PluginError) as info:
        registry.register("norm", other, source="someplug 2.0")
    message = str(info.value)
    assert "duplicate blueprint 'norm'" in message
    assert BUILTIN_SOURCE in message and "someplug 2.0" in message
    assert registry.get("norm") is BLUEPRINTS.get("norm")


def test_registering_the_same_object_twice_is_harmless() -> None:
    registry = fresh_blueprints()
    norm = BLUEPRINTS.get("norm")
    assert registry.register("norm", norm) is norm
    assert registry.names().count("norm") == 1


def test_entry_point_clashing_with_a_builtin_names_both_sources(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(
        write_dist(
            tmp_path / "dup",
            "esper-dupplug",
            "esper_dupplug",
            {"conv_light": "esper_dupplug:BLUEPRINT"},
            PLUGIN_MODULE.format(name="conv_light"),
        )
    )
    registry = fresh_blueprints()
    with pytest.raises(PluginError) as info:
        registry.names()
    message = str(info.value)
    assert "duplicate blueprint 'conv_light'" in message
    assert f"registered by {BUILTIN_SOURCE} and again by esper-dupplug 0.1" in message
    assert GROUP in message


def test_two_distributions_claiming_one_name_are_both_named(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(make_testplug(tmp_path))
    plugin_path(
        write_dist(
            tmp_path / "other",
            "esper-otherplug",
            "esper_otherplug",
            {"my_bp": "esper_otherplug:BLUEPRINT"},
            PLUGIN_MODULE.format(name="my_bp"),
        )
    )
    with pytest.raises(PluginError) as info:
        fresh_blueprints().names()
    message = str(info.value)
    assert "duplicate blueprint 'my_bp'" in message
    assert "esper-testplug 0.1" in message and "esper-otherplug 0.1" in message


@pytest.mark.parametrize(
    ("source", "value", "error"),
    [
        ("raise ImportError('no such backend')\n", "esper_brokenplug:BLUEPRINT", "ImportError"),
        ("X = 1\n", "esper_brokenplug:BLUEPRINT", "AttributeError"),
        ("X = 1\n", "esper_nosuchmodule:BLUEPRINT", "ModuleNotFoundError"),
    ],
    ids=["import-error", "missing-attribute", "missing-module"],
)
def test_broken_entry_point_raises_plugin_error_naming_plugin_distribution_and_value(
    tmp_path: Path,
    plugin_path: PluginPath,
    source: str,
    value: str,
    error: str,
) -> None:
    plugin_path(
        write_dist(
            tmp_path / "broken", "esper-brokenplug", "esper_brokenplug", {"bad_bp": value}, source
        )
    )
    registry = fresh_blueprints()
    with pytest.raises(PluginError) as info:
        registry.get("norm")
    message = str(info.value)
    assert "blueprint plugin 'bad_bp'" in message
    assert "esper-brokenplug 0.1" in message
    assert f"entry point {value!r}" in message
    assert error in message
    assert isinstance(info.value.__cause__, Exception)
    # The failure is not forgotten: the next lookup reports it again.
    with pytest.raises(PluginError, match="bad_bp"):
        registry.names()


def test_failed_load_leaves_no_partial_plugins_behind(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(make_testplug(tmp_path))
    broken = write_dist(
        tmp_path / "broken",
        "esper-brokenplug",
        "esper_brokenplug",
        {"bad_bp": "esper_brokenplug:BLUEPRINT"},
        "raise ImportError('boom')\n",
    )
    plugin_path(broken)
    registry = fresh_blueprints()
    with pytest.raises(PluginError):
        registry.names()
    assert set(registry._entries) == {"conv_light", "norm"}
    plugin_path.remove(broken)
    assert "my_bp" in registry.names()  # loads again, now without the broken plugin


def test_entry_point_naming_a_non_blueprint_raises_plugin_error(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(
        write_dist(
            tmp_path / "broken",
            "esper-brokenplug",
            "esper_brokenplug",
            {"bad_bp": "esper_brokenplug:X"},
            "X = 42\n",
        )
    )
    with pytest.raises(
        PluginError, match=r"'bad_bp' from esper-brokenplug 0.1 is not a valid blueprint"
    ):
        fresh_blueprints().names()


def test_unknown_name_raises_key_error_listing_known_names_and_group() -> None:
    with pytest.raises(KeyError) as info:
        fresh_blueprints().get("nope")
    message = str(info.value)
    assert "unknown blueprint 'nope'" in message
    assert "known blueprints: conv_light, norm" in message
    assert GROUP in message


def test_unknown_name_in_the_global_registry_lists_every_builtin() -> None:
    with pytest.raises(KeyError) as info:
        BLUEPRINTS.get("nope")
    for name in ("conv_light", "conv_heavy", "attention", "lora", "mlp"):
        assert name in str(info.value)


def test_unknown_name_in_an_empty_registry_says_none() -> None:
    registry: Registry[int] = Registry("esper.test-nothing-here", "widget")
    with pytest.raises(KeyError, match="known widgets: none"):
        registry.get("x")


@pytest.mark.parametrize("name", ["", "a b", "a.b", "x/y", "bad:name"])
def test_invalid_names_are_rejected_naming_source(name: str) -> None:
    registry: Registry[int] = Registry("esper.test-nothing-here", "widget")
    with pytest.raises(
        PluginError, match=f"widget name {name!r} from somewhere 1.0 is not a valid name"
    ):
        registry.register(name, 1, source="somewhere 1.0")


def test_validator_errors_in_code_registration_propagate() -> None:
    registry = fresh_blueprints(with_builtins=False)
    with pytest.raises(TypeError, match=r"expected an esper\.kasmina\.blueprints\.Blueprint"):
        registry.register("x", 3)  # type: ignore[arg-type]
    assert len(registry) == 0


def test_container_protocol_follows_registration_order() -> None:
    registry: Registry[int] = Registry("esper.test-nothing-here", "widget")
    registry.register("b", 2)
    registry.register("a", 1)
    assert list(registry) == ["b", "a"]
    assert len(registry) == 2
    assert "a" in registry and "c" not in registry
    assert registry.entry("a") == Registered("a", 1, BUILTIN_SOURCE)


def test_entry_point_without_distribution_is_described_as_unknown() -> None:
    ep = EntryPoint(name="x", value="m:x", group=GROUP)
    assert _distribution_of(ep) == "an unknown distribution"


def test_fit_error_from_a_plugin_blueprint_names_it(
    tmp_path: Path, plugin_path: PluginPath
) -> None:
    plugin_path(make_testplug(tmp_path))
    bp = fresh_blueprints().get("my_bp")
    with pytest.raises(BlueprintFitError, match="blueprint 'my_bp'"):
        bp.instantiate(SlotShape("rnn", 8, (4,)))
