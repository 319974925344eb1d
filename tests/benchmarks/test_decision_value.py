"""benchmarks/decision_value.py recovers what a planted decision is worth."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decision_value.py"
WIDE_WORTH = 0.5  # points per fossilized conv_wide, planted below


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("decision_value", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _write_events(path: Path, rollouts: int = 200, envs: int = 4) -> None:
    rng = np.random.default_rng(0)
    lines = []
    for r in range(rollouts):
        for e in range(envs):
            wide, light, pruned, live = rng.integers(0, 4, size=4)
            start = int(rng.integers(2, 10))
            for i, bp in enumerate(["conv_wide"] * wide + ["conv_light"] * light):
                lines.append({"kind": "germinated", "rollout": r, "env": e, "blueprint": bp})
                lines.append(
                    {
                        "kind": "fossilized",
                        "rollout": r,
                        "env": e,
                        "blueprint": bp,
                        "host_epoch": start + i,
                    }
                )
            for _ in range(pruned):
                lines.append({"kind": "germinated", "rollout": r, "env": e, "blueprint": "x"})
                lines.append({"kind": "pruned", "rollout": r, "env": e})
            for _ in range(live):  # still growing when the episode ends
                lines.append({"kind": "germinated", "rollout": r, "env": e, "blueprint": "x"})
            acc = 0.9 + (WIDE_WORTH * wide + rng.normal(0, 0.5)) / 100
            lines.append({"kind": "episode_end", "rollout": r, "env": e, "final_val_acc": acc})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_the_fit_recovers_the_planted_worth_of_a_blueprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_events(tmp_path / "events.jsonl")
    monkeypatch.setattr(sys, "argv", ["decision_value.py", str(tmp_path / "*.jsonl")])
    _load().main()
    lines = {
        " ".join(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()
    }
    wide = lines["fossilized conv_wide"]
    worth, se = float(wide[2]), float(wide[4])
    assert abs(worth - WIDE_WORTH) < 3 * se
    light = lines["fossilized conv_light"]
    assert abs(float(light[2])) < 3 * float(light[4])
