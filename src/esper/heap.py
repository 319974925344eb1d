"""The C heap's freed memory kept in the process while a fit trains (glibc's ``mallopt``).

Why: PyTorch's CPU tensors come from ``malloc``. glibc hands a freed block of more than
its mmap threshold, and the free top of a heap beyond its trim threshold, back to the
kernel, so the next epoch's activations of the same size fault every page in again, each
page zeroed by the kernel. A host epoch on the CPU makes and frees the same few sizes
thousands of times: in side_by_side.sh's 4-env fit (3x32x32 images, 2 worker threads)
that was 11 600 page faults an epoch, 5 000 with the thresholds raised, most epochs none
(benchmarks/README.md, "The C heap's freed memory"). The memory kept is what the fit had
already used at its peak.

Only glibc's allocator is touched, through the process's own ``mallopt`` (a preloaded
allocator that defines it gets the call instead; one that does not ignores glibc's
settings anyway). A process whose environment already tunes glibc's malloc
(``GLIBC_TUNABLES`` naming ``glibc.malloc``, or a ``MALLOC_*_`` variable) keeps its own
settings.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from esper.contracts.config_errors import ConfigError, owned_by, require_int

MIB = 1 << 20
#: glibc's own ceiling for the mmap threshold on a 64-bit system
#: (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x sizeof(long)).
GLIBC_MMAP_THRESHOLD_MAX = 32 * MIB
#: glibc's default top pad (``mallopt(3)``), restored when a fit ends.
GLIBC_DEFAULT_TOP_PAD = 128 * 1024
#: ``mallopt`` parameters (``<malloc.h>``).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: Environment variables through which a user tunes glibc's malloc themselves.
MALLOC_ENVIRONMENT = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


@dataclass(frozen=True)
class HeapRetention:
    """How much freed memory glibc keeps while a fit trains.

    Attributes:
        mmap_threshold: blocks up to this many bytes come from the heap (and return to
            it when freed) rather than from their own ``mmap``; glibc caps it at 32 MiB.
        trim_threshold: free memory at a heap's top up to this many bytes stays in the
            process.
        top_pad: bytes a heap grows by beyond what a request needs, so that growing
            again is rare.

    Why these defaults: with them a scratch epoch of side_by_side.sh's 4 envs (two worker
    threads) faulted 15 to 1 300 pages against 16 000 to 21 000 with glibc's own, and the
    fit 5 000 an epoch against 11 600; smaller ones (mmap 16 MiB, trim 64 MiB, pad 4 MiB)
    did as well on the scratch epoch, and these leave room for larger hosts' maps.
    """

    mmap_threshold: int = GLIBC_MMAP_THRESHOLD_MAX
    trim_threshold: int = 256 * MIB
    top_pad: int = 16 * MIB

    def __post_init__(self) -> None:
        with owned_by(self):
            require_int("mmap_threshold", self.mmap_threshold, 0)
            if self.mmap_threshold > GLIBC_MMAP_THRESHOLD_MAX:
                raise ConfigError(
                    "mmap_threshold",
                    f"must be at most {GLIBC_MMAP_THRESHOLD_MAX} (glibc's ceiling, 32 MiB), "
                    f"got {self.mmap_threshold}",
                )
            require_int("trim_threshold", self.trim_threshold, 0)
            require_int("top_pad", self.top_pad, 0)


def user_tunes_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment sets glibc's malloc parameters itself."""
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "") or any(
        name in environ for name in MALLOC_ENVIRONMENT
    )


def _mallopt() -> Callable[[int, int], int] | None:
    """The process's ``mallopt``, or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(None), "mallopt", None)


#: Who keeps freed memory now (a fit, an evaluation inside it), guarded by
#: ``_HOLDERS_LOCK``: the settings are applied by the first and put back by the last.
_holders: list[HeapRetention] = []
_HOLDERS_LOCK = threading.Lock()


def keep_freed_memory(retention: HeapRetention) -> bool:
    """Raise glibc's thresholds to ``retention``'s; False (nothing changed) where the C
    library is not glibc or the environment tunes malloc itself. Calls nest: while one
    keeps, a second (an evaluation a fit's callback runs) joins the first's settings, and
    only the last :func:`release_freed_memory` hands the memory back."""
    mallopt = _mallopt()
    if mallopt is None or user_tunes_malloc():
        return False
    with _HOLDERS_LOCK:
        if not _holders:
            settings = (
                (M_MMAP_THRESHOLD, retention.mmap_threshold),
                (M_TRIM_THRESHOLD, retention.trim_threshold),
                (M_TOP_PAD, retention.top_pad),
            )
            for parameter, value in settings:
                if mallopt(parameter, value) != 1:
                    _put_back(retention)  # what was set before the refusal goes back
                    raise OSError(f"glibc's mallopt refused parameter {parameter} = {value}")
        _holders.append(retention)
    return True


def release_freed_memory(retention: HeapRetention) -> None:
    """End one :func:`keep_freed_memory` that returned True; the last one hands the kept
    memory back to the kernel and stops keeping it.

    glibc cannot go back to its adaptive thresholds once set, so the mmap threshold stays
    at ``retention``'s and the trim threshold becomes twice it, where glibc's own adaptive
    rule puts them after freeing blocks that large; the top pad returns to glibc's default.
    """
    with _HOLDERS_LOCK:
        if retention in _holders:
            _holders.remove(retention)
        if not _holders:
            _put_back(retention)


def _put_back(retention: HeapRetention) -> None:
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(M_TRIM_THRESHOLD, 2 * retention.mmap_threshold)
    mallopt(M_TOP_PAD, GLIBC_DEFAULT_TOP_PAD)
    ctypes.CDLL(None).malloc_trim(0)


@contextmanager
def freed_memory_kept(retention: HeapRetention | None = None) -> Iterator[bool]:
    """Keep freed memory for the block (:func:`keep_freed_memory`), then hand it back;
    yields whether the settings were applied."""
    retention = retention if retention is not None else HeapRetention()
    keeping = keep_freed_memory(retention)
    try:
        yield keeping
    finally:
        if keeping:
            release_freed_memory(retention)
