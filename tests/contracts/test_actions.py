"""The factored action schema (contracts/actions.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from esper.contracts import ActionSchema, BlendMode, HeadSpec, LifecycleOp
from esper.contracts.actions import HEAD_NAMES

SCHEMA = ActionSchema(
    slot_ids=("stage0", "stage1", "stage2"),
    blueprint_names=("conv_light", "norm"),
)


def test_heads_are_op_slot_blueprint_blend_in_order_with_their_sizes() -> None:
    assert SCHEMA.heads == (
        HeadSpec("op", len(LifecycleOp)),
        HeadSpec("slot", 3),
        HeadSpec("blueprint", 2),
        HeadSpec("blend", len(BlendMode)),
    )
    assert tuple(h.name for h in SCHEMA.heads) == HEAD_NAMES


def test_default_blend_modes_are_all_modes() -> None:
    assert SCHEMA.blend_modes == tuple(BlendMode)


def test_custom_blend_modes_set_blend_head_size() -> None:
    schema = ActionSchema(("a",), ("b",), blend_modes=(BlendMode.LINEAR,))
    assert dict((h.name, h.size) for h in schema.heads)["blend"] == 1


@pytest.mark.parametrize(
    ("op", "heads"),
    [
        (LifecycleOp.WAIT, ("op",)),
        (LifecycleOp.GERMINATE, ("op", "slot", "blueprint", "blend")),
        (LifecycleOp.ADVANCE, ("op", "slot")),
        (LifecycleOp.PRUNE, ("op", "slot")),
    ],
)
def test_heads_for_op_lists_exactly_the_heads_that_op_uses(
    op: LifecycleOp, heads: tuple[str, ...]
) -> None:
    assert ActionSchema.heads_for_op(op) == heads
    assert ActionSchema.heads_for_op(int(op)) == heads  # plain ints from tensors work too


def test_heads_for_unknown_op_raises() -> None:
    with pytest.raises(ValueError):
        ActionSchema.heads_for_op(len(LifecycleOp))


def test_head_usage_table_matches_heads_for_op_row_by_row() -> None:
    table = ActionSchema.head_usage()
    assert len(table) == len(LifecycleOp)
    for op, row in zip(LifecycleOp, table, strict=True):
        assert len(row) == len(HEAD_NAMES)
        used = ActionSchema.heads_for_op(op)
        assert row == tuple(name in used for name in HEAD_NAMES)
    # The op head is used by every op; blueprint and blend only by GERMINATE.
    assert all(row[0] for row in table)
    assert [row[2] for row in table] == [op is LifecycleOp.GERMINATE for op in LifecycleOp]
    assert [row[3] for row in table] == [op is LifecycleOp.GERMINATE for op in LifecycleOp]


@pytest.mark.parametrize("field", ["slot_ids", "blueprint_names", "blend_modes"])
def test_empty_head_is_rejected_naming_the_field(field: str) -> None:
    kwargs = {"slot_ids": ("s",), "blueprint_names": ("b",), field: ()}
    with pytest.raises(ValueError, match=f"ActionSchema.{field} is empty"):
        ActionSchema(**kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("slot_ids", ("s", "s")),
        ("blueprint_names", ("b", "c", "b")),
        ("blend_modes", (BlendMode.LINEAR, BlendMode.LINEAR)),
    ],
)
def test_duplicate_choices_are_rejected_naming_the_field(field: str, value: tuple) -> None:
    kwargs = {"slot_ids": ("s",), "blueprint_names": ("b",), field: value}
    with pytest.raises(ValueError, match=f"ActionSchema.{field} has duplicates"):
        ActionSchema(**kwargs)


@given(
    n_slots=st.integers(1, 12),
    n_blueprints=st.integers(1, 20),
    modes=st.sets(st.sampled_from(list(BlendMode)), min_size=1),
)
def test_head_sizes_equal_the_number_of_choices(
    n_slots: int, n_blueprints: int, modes: set[BlendMode]
) -> None:
    schema = ActionSchema(
        tuple(f"s{i}" for i in range(n_slots)),
        tuple(f"b{i}" for i in range(n_blueprints)),
        tuple(sorted(modes)),
    )
    sizes = {h.name: h.size for h in schema.heads}
    assert sizes == {
        "op": len(LifecycleOp),
        "slot": n_slots,
        "blueprint": n_blueprints,
        "blend": len(modes),
    }
