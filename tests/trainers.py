"""A Lightning Trainer for tests that run a real fit: no logger, checkpoints, bar or summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L


def quiet_trainer(tmp_path: Path, max_epochs: int = 1, **kwargs: Any) -> L.Trainer:
    """A Trainer writing nothing but under ``tmp_path``; ``kwargs`` add or override options."""
    options: dict[str, Any] = {
        "max_epochs": max_epochs,
        "default_root_dir": tmp_path,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return L.Trainer(**options)
