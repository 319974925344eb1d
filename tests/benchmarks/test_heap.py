"""``benchmarks/heap.py``: fits with glibc's freed memory kept or handed back, measured
from outside their processes."""

from __future__ import annotations

import sys

import pytest

from tests.benchmarks.loading import load_benchmark
from tests.test_heap import glibc_only

heap = load_benchmark("heap")

#: A child that mallocs, writes and frees an 8 MiB block 5 times: under glibc's own
#: settings the first is its own mmap, so at least its pages fault in (glibc's adaptive
#: threshold may serve the later ones from the heap).
TOUCH = (
    "import ctypes\n"
    "lib = ctypes.CDLL(None); lib.malloc.restype = ctypes.c_void_p\n"
    "lib.free.argtypes = [ctypes.c_void_p]\n"
    "for _ in range(5):\n"
    "    p = lib.malloc(8 << 20); ctypes.memset(p, 1, 8 << 20); lib.free(p)\n"
)


def test_each_variant_sets_glibcs_malloc_its_own_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    kept = heap.environment("kept")
    assert not set(heap.CLEARED) & set(kept)
    assert heap.environment("glibc's own")["GLIBC_TUNABLES"] == "glibc.malloc.check=0"


@glibc_only
def test_a_child_is_measured_from_outside_its_process() -> None:
    env = heap.environment("glibc's own")
    idle = heap.run_child([sys.executable, "-c", "pass"], env)
    touching = heap.run_child([sys.executable, "-c", TOUCH], env)
    assert touching.minor_faults - idle.minor_faults >= 2048 * 0.9
    assert touching.wall_s > 0 and touching.max_rss_mb > 0


def test_a_failing_child_says_what_it_printed() -> None:
    failing = [sys.executable, "-c", "import sys; sys.exit('no such data')"]
    with pytest.raises(RuntimeError, match=r"failed \(1\):\nno such data"):
        heap.run_child(failing, heap.environment("kept"))


def test_an_update_costs_what_the_longer_fit_adds() -> None:
    short, long = heap.Run(10.0, 1000, 400.0), heap.Run(16.0, 7000, 450.0)
    assert heap.per_update(short, long, 4) == heap.PerUpdate(2.0, 2000.0, 450.0)


def test_main_interleaves_the_variants_and_prints_their_medians(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fits: list[tuple[list[str], str]] = []

    def fake_fit(command: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
        fits.append((command, env.get("GLIBC_TUNABLES", "")))
        updates = int(command[command.index("--trainer.max_epochs") + 1])
        kept = "GLIBC_TUNABLES" not in env
        return heap.Run(updates * (1.0 if kept else 1.5), updates * (10 if kept else 900), 300.0)

    monkeypatch.setattr(heap, "run_child", fake_fit)
    monkeypatch.setattr(sys, "argv", ["heap.py", "--rounds", "2", "--", "--data.n_train", "32"])
    heap.main()
    assert [env for _, env in fits] == ["", "", "glibc.malloc.check=0", "glibc.malloc.check=0"] * 2
    assert all(command[-2:] == ["--data.n_train", "32"] for command, _ in fits)
    assert all(command[1:4] == ["-m", "esper", "fit"] for command, _ in fits)
    out = capsys.readouterr().out
    assert "kept 1.000 s/update, 10 faults/update; glibc's own 1.500 s/update, 900" in out
    assert "median -0.500 s/update (2 of 2 rounds faster kept)" in out
