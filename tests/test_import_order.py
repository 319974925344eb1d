"""Packages import only downward, in one stated order, and no modules import each other.

Every ``import`` of every module under ``src/esper`` counts: at the top, inside functions
and under ``TYPE_CHECKING`` alike, since each is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: The packages from the bottom up; a module may import its own package, anything in a
#: lower layer, and packages of its own layer that the layer lists before it (the
#: foundation's small modules).
LAYERS: tuple[tuple[str, ...], ...] = (
    # plain data, user-named devices, the plugin registry, thread counts, the host-read
    # counter, the C heap
    (
        "esper",
        "esper.contracts",
        "esper.devices",
        "esper.plugins",
        "esper.threads",
        "esper.host_reads",
        "esper.heap",
    ),
    ("esper.kasmina",),  # host models, seed slots, the lifecycle
    ("esper.tolaria",),  # host epochs for a batch of envs, the host data
    ("esper.tamiyo",),  # the controllers: policy network, masks, features, baselines
    ("esper.mdp",),  # the growth MDP: env, rewards, governor mechanics, the rollout loop
    ("esper.report",),  # pictures and statistics of what a run wrote
    ("esper.callbacks",),  # Lightning callbacks: telemetry, governor, checkpoints
    ("esper.simic",),  # learning: buffer, GAE, normaliser, PPO, the LightningModule
    ("esper.evaluation",),  # controllers against the controls, on paired episodes
    ("esper.cli", "esper.__main__"),  # the commands
)


def module_names(src: Path) -> dict[str, Path]:
    """Every module under ``src`` by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports(src: Path) -> dict[str, set[str]]:
    """Each module's imports of other modules under ``src`` (``from pkg import name``
    counts as an import of ``pkg.name`` when that is a module, else of ``pkg``)."""
    modules = module_names(src)
    roots = {name.split(".")[0] for name in modules}

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] not in roots:
                    continue
                module = resolve(target)
                if module is not None and module != name:
                    found[name].add(module)
    return found


def layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> tuple[int, int] | None:
    """(layer, position in it) of the longest listed package holding ``module``."""
    best: tuple[int, int, int] | None = None
    for i, layer in enumerate(layers):
        for j, package in enumerate(layer):
            inside = module == package or module.startswith(package + ".")
            if inside and (best is None or len(package) > best[2]):
                best = (i, j, len(package))
    return None if best is None else best[:2]


def upward_imports(src: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Every import of a module placed above (or beside, later in its layer) the importer."""
    bad = []
    for importer, targets in sorted(imports(src).items()):
        mine = layer_of(importer, layers)
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if mine is None or theirs is None:
                continue  # reported by the unplaced test
            same_package = mine == theirs
            if not same_package and theirs > mine:
                bad.append(f"{importer} imports {target}, which sits above it")
    return bad


def cycles(src: Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan)."""
    graph = imports(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(module_names(src)):
        if v not in index:
            visit(v)
    return found


# ------------------------------------------------------------------------ esper itself
def test_every_module_sits_in_a_stated_layer() -> None:
    unplaced = [m for m in module_names(SRC) if layer_of(m, LAYERS) is None]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_every_package_folder_is_a_regular_package() -> None:
    """setuptools' ``packages.find`` skips folders without ``__init__.py``: an installed
    (non-editable) Esper would lack them."""
    holding_modules = {path.parent for path in SRC.rglob("*.py")}
    bare = sorted(
        str(d.relative_to(SRC)) for d in holding_modules if not (d / "__init__.py").exists()
    )
    assert not bare, f"add __init__.py to {bare}"


def test_packages_import_only_downward() -> None:
    bad = upward_imports(SRC, LAYERS)
    assert not bad, "\n".join(bad)


def test_no_modules_import_each_other() -> None:
    assert not cycles(SRC)


def test_the_readme_states_the_same_order() -> None:
    """README's Layout table lists the packages bottom-up, as LAYERS does."""
    readme = (SRC.parent / "README.md").read_text()
    section = readme.split("## Layout", 1)[1]
    table = next(block for block in section.split("\n\n") if block.startswith("| package"))
    rows = [line for line in table.splitlines() if line.startswith("| `esper.")]
    stated = [name for row in rows for name in re.findall(r"`(esper\.[\w.]+)`", row.split("|")[1])]
    listed = [p for layer in LAYERS for p in layer if p not in ("esper", "esper.__main__")]
    assert stated == listed


# ------------------------------------------------------------ the checks can fail
def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """``low`` and ``high``: high imports low, and low's function imports high."""
    return _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "def f():\n    from pkg.high.b import g\n    return g\n",
            "pkg/high/__init__.py": "",
            "pkg/high/b.py": "from ..low import a\n\ndef g():\n    return a\n",
        },
    )


def test_an_upward_import_inside_a_function_is_reported(toy: Path) -> None:
    layers = (("pkg",), ("pkg.low",), ("pkg.high",))
    assert upward_imports(toy, layers) == ["pkg.low.a imports pkg.high.b, which sits above it"]
    assert upward_imports(toy, (("pkg",), ("pkg.high",), ("pkg.low",))) == [
        "pkg.high.b imports pkg.low.a, which sits above it"
    ]


def test_modules_importing_each_other_are_a_cycle(toy: Path) -> None:
    assert cycles(toy) == [["pkg.high.b", "pkg.low.a"]]
    (toy / "pkg/low/a.py").write_text("def f():\n    return 1\n")
    assert cycles(toy) == []
