"""glibc keeps freed memory while asked to, hands it back when released, and leaves a
process that tunes malloc itself alone."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from esper import heap
from esper.contracts.config_errors import ConfigError
from esper.heap import (
    GLIBC_DEFAULT_TOP_PAD,
    GLIBC_MMAP_THRESHOLD_MAX,
    M_MMAP_THRESHOLD,
    M_TOP_PAD,
    M_TRIM_THRESHOLD,
    MALLOC_ENVIRONMENT,
    HeapRetention,
    freed_memory_kept,
    keep_freed_memory,
    release_freed_memory,
    user_tunes_malloc,
)

ROOT = Path(__file__).resolve().parents[1]
MALLOC_VARIABLES = ("GLIBC_TUNABLES", *MALLOC_ENVIRONMENT)

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the heap settings are glibc's",
)

BLOCK = 4 << 20  # above glibc's default mmap threshold (128 KiB), below the retention's
BLOCKS = 10  # alive together, then all freed: an epoch's activations
PAGE = os.sysconf("SC_PAGE_SIZE")
EPOCH_PAGES = BLOCKS * BLOCK // PAGE


def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None)
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    return lib


def faults_of_epochs(epochs: int = 4) -> int:
    """Page faults this thread takes for ``epochs`` rounds of ``BLOCKS`` blocks malloced
    and written, then all freed, after one such round untimed: what host epochs do with
    their activations."""

    def epoch() -> None:
        lib = libc()
        pointers = [lib.malloc(BLOCK) for _ in range(BLOCKS)]
        assert all(pointers)
        for pointer in pointers:
            ctypes.memset(pointer, 1, BLOCK)
        for pointer in pointers:
            lib.free(pointer)

    epoch()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(epochs):
        epoch()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def faults_in_a_fresh_process(ask: bool, environ: dict[str, str] | None = None) -> tuple[bool, int]:
    """Whether ``keep_freed_memory`` applied (if ``ask``) and the faults of
    :func:`faults_of_epochs`, in a new process whose heap nothing has used yet; the
    environment's malloc variables are ``environ``'s alone."""
    script = (
        "from esper.heap import HeapRetention, keep_freed_memory\n"
        "from tests.test_heap import faults_of_epochs\n"
        f"applied = {ask} and keep_freed_memory(HeapRetention())\n"
        "print(applied, faults_of_epochs())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES} | (environ or {})
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied == "True", int(faults)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


@pytest.fixture
def glibc_defaults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No malloc variables in the environment; glibc's default thresholds (fixed at 128
    KiB) again after the test, whatever it did."""
    for name in MALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    heap._holders.clear()  # a failed test may leave one behind
    lib = ctypes.CDLL(None)
    lib.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    lib.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    lib.malloc_trim(0)


@glibc_only
def test_kept_freed_memory_takes_no_page_faults_for_an_epochs_blocks() -> None:
    # With glibc's own settings, the freed blocks go back to the kernel each epoch.
    applied, faults = faults_in_a_fresh_process(ask=False)
    assert not applied and faults >= 4 * EPOCH_PAGES * 0.9
    applied, faults = faults_in_a_fresh_process(ask=True)
    assert applied and faults < EPOCH_PAGES // 100


@glibc_only
def test_release_hands_the_kept_memory_back_to_the_kernel(glibc_defaults: None) -> None:
    lib = libc()
    retention = HeapRetention()
    assert keep_freed_memory(retention)
    size = 24 << 20  # under the mmap threshold: from the heap, kept there when freed
    pointer = lib.malloc(size)
    ctypes.memset(pointer, 1, size)
    lib.free(pointer)
    kept = resident_bytes()
    release_freed_memory(retention)
    assert kept - resident_bytes() >= size * 0.9


@glibc_only
def test_a_nested_keep_leaves_the_memory_kept_until_the_outer_one_ends(
    glibc_defaults: None,
) -> None:
    lib = libc()
    outer, inner = HeapRetention(), HeapRetention()
    assert keep_freed_memory(outer) and keep_freed_memory(inner)
    size = 24 << 20
    pointer = lib.malloc(size)
    ctypes.memset(pointer, 1, size)
    lib.free(pointer)
    kept = resident_bytes()
    release_freed_memory(inner)  # an evaluation inside a fit ends
    assert resident_bytes() > kept - size // 10
    release_freed_memory(outer)
    assert kept - resident_bytes() >= size * 0.9


@glibc_only
def test_a_block_that_fails_still_hands_the_kept_memory_back(glibc_defaults: None) -> None:
    lib = libc()
    size = 24 << 20
    with pytest.raises(RuntimeError, match="inside"), freed_memory_kept() as keeping:
        assert keeping
        pointer = lib.malloc(size)
        ctypes.memset(pointer, 1, size)
        lib.free(pointer)
        kept = resident_bytes()
        raise RuntimeError("inside")
    assert kept - resident_bytes() >= size * 0.9


@glibc_only
def test_an_environment_that_tunes_malloc_keeps_its_own_settings() -> None:
    tuned = {"GLIBC_TUNABLES": "glibc.malloc.check=0"}  # glibc's default, as a user's own
    applied, faults = faults_in_a_fresh_process(ask=True, environ=tuned)
    assert not applied and faults >= 4 * EPOCH_PAGES * 0.9


def test_user_tunes_malloc_reads_glibcs_own_variables() -> None:
    assert not user_tunes_malloc({})
    assert not user_tunes_malloc({"GLIBC_TUNABLES": "glibc.rtld.nns=2"})
    assert user_tunes_malloc({"GLIBC_TUNABLES": "glibc.rtld.nns=2:glibc.malloc.trim_threshold=0"})
    assert user_tunes_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})


def test_a_refused_setting_puts_back_what_was_set_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []

    def mallopt(parameter: int, value: int) -> int:
        calls.append((parameter, value))
        return 0 if parameter == M_TOP_PAD and value == HeapRetention().top_pad else 1

    monkeypatch.setattr(heap, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: SimpleNamespace(malloc_trim=lambda pad: 0))
    for name in MALLOC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(OSError, match="refused parameter -2"):
        keep_freed_memory(HeapRetention())
    retention = HeapRetention()
    assert calls == [
        (M_MMAP_THRESHOLD, retention.mmap_threshold),
        (M_TRIM_THRESHOLD, retention.trim_threshold),
        (M_TOP_PAD, retention.top_pad),
        (M_TRIM_THRESHOLD, 2 * retention.mmap_threshold),
        (M_TOP_PAD, GLIBC_DEFAULT_TOP_PAD),
    ]


def test_a_c_library_other_than_glibc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert not keep_freed_memory(HeapRetention())
    release_freed_memory(HeapRetention())  # nothing to hand back: no call, no error


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("mmap_threshold", GLIBC_MMAP_THRESHOLD_MAX + 1, "at most 33554432"),
        ("mmap_threshold", -1, "int >= 0"),
        ("trim_threshold", 1.5, "int >= 0"),
        ("top_pad", True, "int >= 0"),
    ],
)
def test_heap_retention_names_a_bad_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=f"HeapRetention.{field}: .*{match}"):
        HeapRetention(**{field: value})  # type: ignore[arg-type]
