"""docs/metrics.md explains every scalar a run logs: a tag a run writes but the page
does not name is a figure a user cannot read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from esper.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

#: A run small enough for the suite that still logs every family (profile debug adds the
#: per-step scalars; the callbacks are esper fit's defaults plus telemetry's debug view).
TINY_DEBUG_RUN = """\
model:
  n_envs: 2
  episode_epochs: 3
  host_kwargs:
    channels: [4, 8]
data:
  class_path: esper.tolaria.data.SyntheticImageDataModule
  init_args:
    n_train: 64
    n_val: 32
    batch_size: 16
trainer:
  max_epochs: 1
  enable_progress_bar: false
  callbacks:
    - class_path: esper.callbacks.TelemetryCallback
      init_args:
        profile: debug
"""


def documented_tags() -> list[re.Pattern[str]]:
    """Each backticked tag in the page's tables as a pattern: ``<placeholder>`` matches one
    path part (``reward/<component>`` matches ``reward/terminal``)."""
    patterns = []
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            continue
        first_cell = line.split("|")[1]
        for tag in re.findall(r"`([^`]+)`", first_cell):
            parts = [re.escape(p) for p in re.split(r"<[^>]+>", tag)]
            patterns.append(re.compile("[^/]+".join(parts) + "$"))
    return patterns


def test_the_page_names_each_family_the_issue_lists() -> None:
    text = DOC.read_text()
    for family in ("reward/", "masks/", "lifecycle/", "stages/", "perf/", "ppo/", "train/"):
        assert f"`{family}" in text, f"docs/metrics.md does not explain {family}*"


@pytest.mark.slow
def test_every_scalar_a_run_logs_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["esper"])
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_DEBUG_RUN)
    root = tmp_path / "run"
    assert (
        main(
            [
                "fit",
                "--config",
                str(config),
                "--callbacks=[governor,timeline]",
                "--trainer.default_root_dir",
                str(root),
            ]
        )
        == 0
    )
    (events,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"]) | set(acc.Tags()["histograms"])
    assert len(tags) > 20, sorted(tags)  # the run logged the families, not a handful
    patterns = documented_tags()
    unexplained = sorted(t for t in tags if not any(p.match(t) for p in patterns))
    assert not unexplained, f"logged but not in docs/metrics.md: {unexplained}"
