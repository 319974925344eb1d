"""Devices a user names (a CLI option, a config field): parsed, and tried on this machine.

Why: torch's own errors for these are a traceback from deep inside a run ("Torch not
compiled with CUDA enabled" once the policy moves, "Expected one of cpu, cuda, ..." for a
typo), after the checkpoint has loaded and, for ``esper evaluate``, before anything is
measured. Checked where the value arrives, they are one line naming the setting.
"""

from __future__ import annotations

import torch

from esper.contracts.config_errors import ConfigError


def parse_device(value: str, key: str, also: str = "") -> torch.device:
    """``value`` as a device; a ConfigError under ``key`` where torch knows no such device
    (``also``: what else the setting takes, said after the examples)."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            key, f"must name a device such as 'cpu' or 'cuda:0'{also}, got {value!r}"
        ) from exc


def check_usable(device: torch.device, key: str) -> None:
    """A ConfigError under ``key`` where this machine cannot put a tensor on ``device``
    (CUDA named where torch has none, or a GPU index past the last)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:  # AssertionError: torch built without CUDA
        raise ConfigError(
            key, f"names {device}, which this machine cannot use: {' '.join(str(exc).split())}"
        ) from exc
