"""``esper evaluate``'s picture: each controller at (training GFLOP, test accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from esper.report.statistics import clustered_mean
from esper.report.tradeoff import _flops_interval, render_accuracy_vs_flops

SMALL = (400, 300)
GROUPS = [0, 0, 1, 1, 2, 2]


def evaluation(tmp_path: Path, learned_acc: float = 0.95) -> Path:
    flops = {
        "learned": [1.0e9, 1.1e9, 0.9e9, 1.0e9, 1.2e9, 0.8e9],
        "no_growth": [0.4e9] * 6,
    }
    rows = [
        {
            "controller": name,
            "episodes": 6,
            "final_test_acc_mean": acc,
            "final_test_acc_low": acc - 0.01,
            "final_test_acc_high": acc + 0.01,
            "train_flops_mean": float(np.mean(flops[name])),
        }
        for name, acc in (("learned", learned_acc), ("no_growth", 0.90))
    ]
    payload = {
        "seed": 1000,
        "seed_range": "reporting",
        "episode_group": GROUPS,
        "rows": rows,
        "train_flops": flops,
    }
    path = tmp_path / f"evaluation_{learned_acc}.json"
    path.write_text(json.dumps(payload))
    return path


def test_the_picture_has_the_asked_size_and_is_written_as_drawn(tmp_path: Path) -> None:
    out = tmp_path / "accuracy_vs_flops.png"
    image = render_accuracy_vs_flops(evaluation(tmp_path), out, size=SMALL)
    assert image.shape == (SMALL[1], SMALL[0], 3) and image.dtype == np.uint8
    assert np.array_equal((imread(out)[..., :3] * 255).round().astype(np.uint8), image)


def test_a_controllers_accuracy_moves_its_point(tmp_path: Path) -> None:
    low = render_accuracy_vs_flops(evaluation(tmp_path, 0.95), size=SMALL)
    high = render_accuracy_vs_flops(evaluation(tmp_path, 0.97), size=SMALL)
    assert not np.array_equal(low, high)


def test_the_flops_interval_counts_each_episode_group_once(tmp_path: Path) -> None:
    payload = json.loads(evaluation(tmp_path).read_text())
    mean, low, high = _flops_interval(payload, "learned", GROUPS, 0.0)
    expected = clustered_mean(payload["train_flops"]["learned"], GROUPS)
    assert (mean, low, high) == (expected.mean, expected.low, expected.high)
    # Without per-episode figures the mean stands alone (no bar is drawn).
    assert _flops_interval({}, "learned", GROUPS, 5.0) == (5.0, None, None)


def _title(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The title the picture of ``path`` is drawn with."""
    from esper.report import tradeoff

    titles: list[str] = []
    real = tradeoff.figure_to_array

    def keep(fig, width: int, height: int) -> np.ndarray:  # type: ignore[no-untyped-def]
        titles.append(fig.axes[0].get_title())
        return real(fig, width, height)

    monkeypatch.setattr(tradeoff, "figure_to_array", keep)
    render_accuracy_vs_flops(path, size=SMALL)
    return titles[-1]


def test_the_title_promises_bars_only_where_some_are_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One episode group has no interval: the title said "bars: 95% intervals" over
    points without bars."""
    assert _title(evaluation(tmp_path), monkeypatch).endswith("bars: 95% intervals")
    payload = json.loads(evaluation(tmp_path).read_text())
    payload["episode_group"] = [0] * 6
    for row in payload["rows"]:
        row["final_test_acc_low"] = row["final_test_acc_high"] = None  # NaN, written as null
    one_group = tmp_path / "one_group.json"
    one_group.write_text(json.dumps(payload))
    title = _title(one_group, monkeypatch)
    assert title.endswith("no bars: one episode group gives no interval"), title


def test_a_file_that_is_not_an_evaluation_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "events.jsonl"
    bad.write_text('{"kind": "ppo_update"}')
    with pytest.raises(ValueError, match=r"events\.jsonl: no evaluation rows"):
        render_accuracy_vs_flops(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json: not JSON"):
        render_accuracy_vs_flops(broken)


def test_names_of_controllers_at_one_place_go_on_separate_lines() -> None:
    from esper.report.tradeoff import _label_offsets

    offsets = _label_offsets([(1.48, 0.9708), (0.4, 0.90), (1.48, 0.9699), (0.96, 0.95)])
    assert offsets[0] != offsets[2]  # static_final and static_equal coincide
    assert offsets[0] == offsets[1] == offsets[3]  # apart from the others: beside the marker
