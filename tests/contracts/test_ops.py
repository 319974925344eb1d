"""The op head's choices and the blend modes (contracts/ops.py)."""

from __future__ import annotations

from esper.contracts import BlendMode, LifecycleOp


def test_lifecycle_ops_are_dense_indices_with_wait_first() -> None:
    assert [int(op) for op in LifecycleOp] == list(range(len(LifecycleOp)))
    assert LifecycleOp(0) is LifecycleOp.WAIT
    assert {op.name for op in LifecycleOp} == {"WAIT", "GERMINATE", "ADVANCE", "PRUNE"}


def test_blend_modes_are_dense_indices_covering_the_design_schedules() -> None:
    assert [int(m) for m in BlendMode] == list(range(len(BlendMode)))
    assert {m.name for m in BlendMode} == {"LINEAR", "COSINE", "SIGMOID", "GATED"}
