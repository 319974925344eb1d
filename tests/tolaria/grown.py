"""Envs grown as a test asks, for the stacked engine's and the worker threads' tests.

:func:`planted` builds envs to a plan (each seed planted and brought to its stage);
:func:`grown_envs` draws such plans at random, as hypothesis cases (:class:`Grown`):
hosts that group and differ where a group must treat members differently. Property
tests run them in float64 (:func:`float64_default`, :func:`float64_loaders`), where
float rounding cannot hide a member trained wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from esper.contracts import BlendMode, SeedStage
from esper.kasmina import CNNHost, GrowingHost, TransformerHost
from esper.kasmina.hosts.base import HostModel
from tests.tolaria.loaders import image_loaders
from tests.tolaria.test_epoch import FAST, to_stage

#: Per env, its seeds: (slot, blueprint, blend mode, stage).
Plan = list[list[tuple[str, str, BlendMode, SeedStage]]]


def planted(plan: Plan, host: Callable[[], HostModel] | None = None) -> list[GrowingHost]:
    """One env per entry of ``plan`` (random state seeded alike), each seed planted and
    brought to its stage; hosts from ``host`` (default the CNN of these tests)."""
    torch.manual_seed(0)
    made = [
        GrowingHost(CNNHost(channels=(8, 16), lifecycle=FAST) if host is None else host())
        for _ in plan
    ]
    for env, seeds in zip(made, plan, strict=True):
        for slot_id, blueprint, mode, stage in seeds:
            env.germinate(slot_id, blueprint, mode)
            to_stage(env, slot_id, stage)
    return made


#: Blueprints a CNN slot takes, widenings twice as likely (the default catalogue's).
FUZZ_BLUEPRINTS = ("conv_light", "conv_heavy", "conv_wide", "depthwise", "bottleneck", "norm")
FUZZ_BLUEPRINTS += ("widen", "widen", "widen")
#: The same for a transformer block.
TRANSFORMER_FUZZ_BLUEPRINTS = ("attention", "lora", "mlp", "norm", "widen", "widen")
#: The stages a training step treats differently, a seed just planted included; TRAINING
#: and BLENDING twice as likely, as a group treats members differently there the most.
FUZZ_STAGES = (
    SeedStage.GERMINATED,
    SeedStage.TRAINING,
    SeedStage.TRAINING,
    SeedStage.BLENDING,
    SeedStage.BLENDING,
    SeedStage.HOLDING,
    SeedStage.FOSSILIZED,
)


@dataclass(frozen=True)
class Grown:
    """Envs grown at random (:func:`grown_envs`) and the batches they train on."""

    plan: Plan
    #: Host epochs each env's seeds BLENDING have ramped past their first.
    ramps: list[int]
    #: Channels per stage of every env's host: a slot per stage.
    channels: tuple[int, ...]
    batch: int
    paired: int | None
    #: Transformer hosts of a block per entry of ``channels`` (else CNN hosts).
    transformer: bool = False

    def envs(self) -> list[GrowingHost]:
        def host() -> HostModel:
            if self.transformer:
                layers = len(self.channels)
                return TransformerHost(seq_len=12, d_model=32, n_layers=layers, lifecycle=FAST)
            return CNNHost(channels=self.channels, lifecycle=FAST)

        made = planted(self.plan, host)
        for env, ramp in zip(made, self.ramps, strict=True):
            for slot in env.model.iter_slots():
                for _ in range(ramp if slot.stage is SeedStage.BLENDING else 0):
                    slot.end_epoch()
        return made

    def loaders(self) -> tuple[DataLoader, DataLoader]:
        """Three batches to train on and one to validate: images in float64, or tokens."""
        if not self.transformer:
            return float64_loaders(batch=self.batch, n_train=3 * self.batch)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 16, (4 * self.batch, 13), generator=g)
        return tuple(  # type: ignore[return-value]
            DataLoader(TensorDataset(t[:, :-1], t[:, 1:]), batch_size=self.batch)
            for t in (tokens[: 3 * self.batch], tokens[3 * self.batch :])
        )

    def training(self) -> dict[str, object]:
        return {} if self.paired is None else {"paired_group": self.paired}


@st.composite
def grown_envs(draw: st.DrawFn, transformer: bool = False) -> Grown:
    """2-7 envs on a host of 2 or 3 stages (or transformer blocks), a batch size (even,
    uneven or small) and a paired-group size (None: unpaired). The envs' hosts are a base
    host (each slot empty or a seed of any blueprint, blend mode and stage) and up to
    three variants of it, each differing in one thing at one slot (the seed's blend mode,
    stage or blueprint, or no seed): hosts that group, and differ where a group must
    treat members differently. Seeds blending in are at the first or a later point of
    their ramp."""
    channels = draw(st.sampled_from([(8, 16), (4, 8, 8)]))
    blueprints = TRANSFORMER_FUZZ_BLUEPRINTS if transformer else FUZZ_BLUEPRINTS
    seed = st.tuples(
        st.sampled_from(blueprints),
        st.sampled_from(list(BlendMode)),
        st.sampled_from(FUZZ_STAGES),
    )
    base = draw(st.tuples(*[st.none() | seed for _ in channels]))
    pool = [base]
    for _ in range(draw(st.integers(0, 3))):
        variant = list(draw(st.sampled_from(pool)))
        k = draw(st.integers(0, len(channels) - 1))
        old = variant[k] or draw(seed)
        field = draw(st.integers(0, 3))
        if field == 3:
            variant[k] = None
        else:
            choices = (blueprints, list(BlendMode), FUZZ_STAGES)[field]
            variant[k] = (*old[:field], draw(st.sampled_from(choices)), *old[field + 1 :])
        pool.append(tuple(variant))
    n = draw(st.integers(2, 7))
    hosts = [draw(st.sampled_from(pool)) for _ in range(n)]
    slot = "block" if transformer else "stage"
    return Grown(
        plan=[[(f"{slot}{k}", *s) for k, s in enumerate(host) if s is not None] for host in hosts],
        ramps=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        channels=channels,
        batch=draw(st.sampled_from([4 * n, 4 * n + 1, 5 * n - 1, 16])),
        paired=draw(st.none() | st.sampled_from([k for k in range(2, n + 1) if n % k == 0])),
        transformer=transformer,
    )


def float64_loaders(batch: int, n_train: int) -> tuple[DataLoader, DataLoader]:
    """:func:`image_loaders`' images in float64, for tests run in float64."""
    train, val = image_loaders(n_train=n_train, batch=batch)
    return tuple(  # type: ignore[return-value]
        DataLoader(TensorDataset(x.double(), y), batch_size=batch)
        for x, y in (train.dataset.tensors, val.dataset.tensors)
    )


@contextmanager
def float64_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
