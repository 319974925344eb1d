"""Many tensor copies as a few multi-tensor copies (tolaria/copies.py)."""

from __future__ import annotations

import pytest
import torch

from esper.tolaria.copies import Copies


def test_every_pair_is_copied_whatever_its_dtype_or_layout() -> None:
    torch.manual_seed(0)
    sources = [
        torch.randn(3, 4),
        torch.randn(5),
        torch.randint(0, 9, (2, 2)),
        torch.tensor([True, False]),
        torch.randn(2, 3).t(),  # strided source
    ]
    wide = torch.zeros(4, 6)
    destinations = [torch.empty(3, 4), torch.empty(5), torch.empty(2, 2, dtype=torch.long)]
    destinations += [torch.empty(2, dtype=torch.bool), wide[:3, :2]]  # a strided corner
    copies = Copies()
    for destination, source in zip(destinations, sources, strict=True):
        copies.add(destination, source)
    copies.run()
    for destination, source in zip(destinations, sources, strict=True):
        assert torch.equal(destination, source)
    assert wide[3:].abs().sum() == 0 and wide[:, 2:].abs().sum() == 0  # only the corner
    before = destinations[0].clone()
    copies.run()  # the pairs were forgotten: nothing copies again
    sources[0].add_(1)
    copies.run()
    assert torch.equal(destinations[0], before)


def test_tensors_are_zeroed_before_any_copy_into_them() -> None:
    stacked = torch.full((3, 4, 4), float("nan"))  # as uninitialised memory may hold
    copies = Copies()
    copies.add(stacked[0, :2, :3], torch.ones(2, 3))
    copies.add(stacked[2], torch.full((4, 4), 2.0))
    copies.zero(stacked)  # added after the copies, run before them
    copies.run()
    assert torch.equal(stacked[0, :2, :3], torch.ones(2, 3))
    assert stacked[0].sum() == 6 and stacked[1].abs().sum() == 0
    assert torch.equal(stacked[2], torch.full((4, 4), 2.0))


def test_a_pair_of_different_shapes_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"equal shapes, got \[2, 3\] from \[3, 2\]"):
        Copies().add(torch.empty(2, 3), torch.empty(3, 2))
