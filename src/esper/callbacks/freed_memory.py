"""Keeps the C heap's freed memory in the process while a fit trains, and hands it back
when the fit ends or fails.

Why: every host epoch on the CPU frees and makes again the same activations; with glibc's
own thresholds the big ones go back to the kernel and return page by page, zeroed
(``esper.heap`` says how, benchmarks/README.md "The C heap's freed memory" what it cost).
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from esper.heap import HeapRetention, keep_freed_memory, release_freed_memory


class KeepFreedMemory(Callback):
    """glibc's heap keeps freed memory (:class:`~esper.heap.HeapRetention`) from the fit's
    start to its end. :class:`~esper.simic.module.PPOModule` adds it to every fit
    (``configure_callbacks``). Nothing changes where the C library is not glibc or the
    environment tunes malloc itself (``GLIBC_TUNABLES``, ``MALLOC_*_``)."""

    def __init__(self, retention: HeapRetention | None = None) -> None:
        if retention is not None and not isinstance(retention, HeapRetention):
            raise TypeError(
                f"KeepFreedMemory(retention=...) takes an esper.heap.HeapRetention, got "
                f"{type(retention).__name__}"
            )
        self.retention = retention if retention is not None else HeapRetention()
        self.keeping = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.keeping:
            self.keeping = keep_freed_memory(self.retention)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._release()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        if self.keeping:
            release_freed_memory(self.retention)
            self.keeping = False
