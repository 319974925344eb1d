"""A probe for tests of the stacked engine: did it train anything stacked?"""

from __future__ import annotations

import pytest

from esper.tolaria.stacked import StackedGroup


def count_stacked_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every group each stacked step trains from now on (for the test)."""
    sizes: list[int] = []
    real_step = StackedGroup.step

    def counted(self: StackedGroup, *args: object, **kwargs: object) -> None:
        sizes.append(self.size)
        real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StackedGroup, "step", counted)
    return sizes
