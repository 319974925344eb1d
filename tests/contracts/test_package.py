"""The contracts package is plain data: importing it must not import torch."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import esper.contracts

SRC = pathlib.Path(esper.contracts.__file__).resolve().parents[2]


def test_importing_contracts_and_all_its_modules_does_not_import_torch() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    code = (
        "import importlib, pkgutil, sys, esper.contracts as c\n"
        "names = [m.name for m in pkgutil.walk_packages(c.__path__, 'esper.contracts.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(len(names))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 4  # stages, ops, actions, observations at least


def test_public_names_are_exported() -> None:
    for name in esper.contracts.__all__:
        assert hasattr(esper.contracts, name), name
