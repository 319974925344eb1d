"""What a timeline picture costs the training process: drawn in line against handed over.

It collects one real rollout (the default env: CNN host on digits, ``--n-envs`` envs,
``--episode-epochs`` epochs), then, ``--pictures`` times each:

* ``in line``: :func:`esper.report.render_timeline` in this process, as the
  TimelineCallback drew until issue 35: the rollout waited this long per drawn rollout;
* ``handed over``: :meth:`BackgroundDrawer.submit`, all the rollout now waits for at its
  end (the helper process started before timing), and the pickling its writer thread
  does beside it;
* ``helper``: from the first submit to the last picture back, per picture: how long the
  helper takes, while training goes on.

Usage: ``python benchmarks/timeline.py [--pictures 5] [--n-envs 4] [--episode-epochs 25]``
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rollout import build

from esper.contracts.rollout import StepBatch
from esper.report.drawer import PROTOCOL, BackgroundDrawer, Job
from esper.report.timeline import render_timeline
from esper.tolaria.data.base import DEFAULT_BATCH_SIZE


def one_rollout(n_envs: int, episode_epochs: int) -> tuple[list[StepBatch], list[str]]:
    """The host-side step batches of one rollout of a fresh policy (the collector
    ``benchmarks/rollout.py`` times), and the slot names."""
    torch.manual_seed(0)
    args = argparse.Namespace(
        data="digits", batch_size=DEFAULT_BATCH_SIZE, episode_epochs=episode_epochs
    )
    collector = build(n_envs, args, torch.device("cpu"))
    steps: list[StepBatch] = []
    collector.collect_batch(0, on_step=steps.append)
    return steps, [str(s) for s in collector.env.slot_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pictures", type=int, default=5)
    parser.add_argument("--n-envs", type=int, default=4)
    parser.add_argument("--episode-epochs", type=int, default=25)
    args = parser.parse_args()

    steps, slot_ids = one_rollout(args.n_envs, args.episode_epochs)
    out = Path(tempfile.mkdtemp(prefix="esper_timeline_"))
    render_timeline(steps, 0, slot_ids)  # matplotlib's first-use costs are not a picture's
    inline = []
    for i in range(args.pictures):
        tick = time.perf_counter()
        render_timeline(steps, 0, slot_ids, path=out / f"inline{i}.png")
        inline.append(time.perf_counter() - tick)

    drawer = BackgroundDrawer()
    try:
        drawer.submit(Job("warm-up", steps, 0, slot_ids, out / "warmup.png"))
        drawer.wait()  # the helper is up and has drawn once
        handed = []
        start = time.perf_counter()
        for i in range(args.pictures):
            tick = time.perf_counter()
            drawer.submit(Job(i, steps, 0, slot_ids, out / f"helper{i}.png"))
            handed.append(time.perf_counter() - tick)
        done = drawer.wait()
        helper = (time.perf_counter() - start) / args.pictures
    finally:
        drawer.close()
    assert len(done) == args.pictures and all(not isinstance(d, Exception) for d in done)

    print(
        f"timeline of a {args.episode_epochs}-epoch episode, {args.n_envs} envs, "
        f"{args.pictures} pictures, threads {torch.get_num_threads()}"
    )
    print(f"  in line (the rollout waits)       {statistics.median(inline) * 1e3:8.1f} ms median")
    print(f"  handed over (the rollout waits)   {statistics.median(handed) * 1e3:8.3f} ms median")
    tick = time.perf_counter()
    payload = pickle.dumps(Job(0, steps, 0, slot_ids, out / "x.png"), protocol=PROTOCOL)
    pickled = time.perf_counter() - tick
    print(
        f"  pickled by the writer thread      {pickled * 1e3:8.3f} ms ({len(payload) / 1e3:.0f} kB)"
    )
    print(f"  helper, per picture (in parallel) {helper * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
