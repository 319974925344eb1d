"""Stacked steps recorded once a group epoch and replayed (``esper.tolaria.step_graph``).

On a CPU the recorder is ``tests/tolaria/op_tape.TapeRecorder``, which holds a step to a
CUDA graph's rules (device work only, on fixed memory, no host reads) and runs the same
kernels, so a recorded epoch must equal an unrecorded one bit for bit. The CUDA tests at
the end run the real recorder where a GPU is at hand.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch.utils.data import DataLoader

from esper.contracts.config_errors import ConfigError
from esper.kasmina import GrowingHost
from esper.mdp.env_config import EnvConfig
from esper.tolaria import step_graph
from esper.tolaria.epoch import run_epoch
from esper.tolaria.host_training import HostTraining
from esper.tolaria.step_graph import CALLS_BEFORE_RECORDING, GraphedStep
from tests.simic.recorded_fit import recorded_fit
from tests.tolaria.grown import Grown, float64_default, grown_envs
from tests.tolaria.loaders import image_loaders
from tests.tolaria.op_tape import HostReadWhileRecording, TapeRecorder
from tests.tolaria.test_stacked import (
    assert_close_results,
    assert_close_states,
    cnn_envs,
    envs_of_different_widths,
    on_cuda,
)


def replays_per_group_epoch(recorder: TapeRecorder, batches: int, epochs: int = 2) -> None:
    """Every group epoch (one recording each) of the first epoch replays all its batches
    but the first, the first one on the device one fewer: its recorder warmed up first.
    A later epoch's groups, whose steps' shapes ran in the first (nothing changed in
    between), are recorded at their first batch and replay every batch."""
    assert recorder.warmed and recorder.recorded
    per_epoch, left = divmod(len(recorder.recorded), epochs)
    assert left == 0, recorder.recorded
    first = (batches - 1) * per_epoch - 1
    assert recorder.replays == first + batches * per_epoch * (epochs - 1)


# ---------------------------------------------------------------- GraphedStep alone
class Calls:
    """A step that notes the inputs it is called with and adds their sum to a total."""

    def __init__(self) -> None:
        self.total = torch.zeros(())
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.seen.append((x, y))
        self.total.add_(x.sum() + y.sum())


def batches(n: int, shape: tuple[int, ...] = (2, 3)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)) for _ in range(n)
    ]


@pytest.mark.parametrize("warmed", [False, True])
def test_a_layout_runs_once_as_it_is_then_is_recorded_and_replayed(warmed: bool) -> None:
    """The first call stacks; a recorder not yet warmed up warms up on the next; the
    next is recorded and replayed, later ones replayed: every batch counted once, from
    the recorded inputs after."""
    calls, recorder = Calls(), TapeRecorder()
    recorder.warmed = warmed
    graphed = GraphedStep(calls, recorder)
    data = batches(6)
    read = [graphed(x, y) for x, y in data]
    assert CALLS_BEFORE_RECORDING == 1
    unrecorded = 1 if warmed else 2
    assert recorder.warmed
    assert (graphed.unrecorded, graphed.recordings, graphed.replays) == (
        unrecorded,
        1,
        6 - unrecorded,
    )
    assert recorder.replays == 6 - unrecorded
    expected = sum(x.sum() + y.sum() for x, y in data)
    torch.testing.assert_close(calls.total, expected, rtol=1e-6, atol=1e-6)
    assert all(read[k][0] is data[k][0] for k in range(unrecorded))
    static = read[unrecorded][0]
    assert all(r[0] is static for r in read[unrecorded:])  # recorded input, refilled each call
    assert torch.equal(static, data[-1][0])


def test_a_step_whose_shapes_ran_before_is_recorded_at_its_first_call() -> None:
    """A step that makes nothing at its first call names its ``shapes``: once a step of
    those shapes and that layout ran as it is on the device, the next such step (the
    group's next epoch) is recorded at its first call; other shapes, another layout or
    another device's recorder run their first call as they are."""
    recorder = TapeRecorder()
    recorder.warmed = True
    data = batches(3)

    def run(
        shapes: object, rec: TapeRecorder = recorder, shape: tuple[int, ...] = (2, 3)
    ) -> GraphedStep:
        graphed = GraphedStep(Calls(), rec, shapes=shapes)
        for x, y in batches(3, shape):
            graphed(x, y)
        return graphed

    first, again = run("group A"), run("group A")
    assert (first.unrecorded, first.recordings, first.replays) == (1, 1, 2)
    assert (again.unrecorded, again.recordings, again.replays) == (0, 1, 3)
    assert run("group B").unrecorded == 1  # shapes not run before
    assert run("group A", shape=(4, 3)).unrecorded == 1  # another layout
    other = TapeRecorder()
    other.warmed = True
    assert run("group A", rec=other).unrecorded == 1  # another device
    assert run(None).unrecorded == run(None).unrecorded == 1  # no shapes: always one first
    calls = Calls()
    graphed = GraphedStep(calls, recorder, shapes="group A")
    for x, y in data:
        graphed(x, y)
    expected = sum(x.sum() + y.sum() for x, y in data)
    torch.testing.assert_close(calls.total, expected, rtol=1e-6, atol=1e-6)


def test_the_shapes_that_ran_are_kept_for_the_last_few_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long run's growth makes new shapes without end: the oldest are let go."""
    monkeypatch.setattr(step_graph, "SHAPES_KEPT", 2)
    recorder = TapeRecorder()
    recorder.warmed = True

    def first_call_unrecorded(shapes: str) -> bool:
        graphed = GraphedStep(Calls(), recorder, shapes=shapes)
        for x, y in batches(2):
            graphed(x, y)
        return graphed.unrecorded == 1

    assert all(first_call_unrecorded(name) for name in ("a", "b", "c"))
    assert not first_call_unrecorded("c") and not first_call_unrecorded("b")
    assert first_call_unrecorded("a")  # let go when "c" ran


def test_another_layout_runs_as_it_is_and_the_recorded_one_still_replays() -> None:
    """A shorter batch (a loader's last) is not recorded; its step runs as it is."""
    calls = Calls()
    graphed = GraphedStep(calls, TapeRecorder())
    long, short = batches(4), batches(2, shape=(1, 3))
    for x, y in long[:3] + short + long[3:]:
        graphed(x, y)
    assert (graphed.unrecorded, graphed.recordings, graphed.replays) == (4, 1, 2)
    expected = sum(x.sum() + y.sum() for x, y in long + short)
    torch.testing.assert_close(calls.total, expected, rtol=1e-6, atol=1e-6)


def test_a_replay_hands_back_the_recordings_outputs_also_after_a_call_of_another_layout() -> None:
    """A step's outputs (an env's loss and correct count) come back with every call: an
    unrecorded call's own, a replay's those the recording made (the graph's memory,
    refilled by the replay), also when a call of another layout ran in between (paired
    envs' shares alternate in size when a batch does not split evenly)."""

    def total(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.sum() + y.sum()

    graphed = GraphedStep(total, TapeRecorder())
    long, short = batches(5), batches(2, shape=(1, 3))
    for x, y in [*long[:3], short[0], *long[3:], short[1]]:
        _, _, out = graphed(x, y)
        torch.testing.assert_close(out, x.sum() + y.sum(), rtol=1e-6, atol=1e-6)
    assert (graphed.recordings, graphed.replays) == (1, 3)


def test_an_expanded_input_is_recorded_expanded() -> None:
    """Paired envs train on one share expanded over the group: the recorded input keeps
    the expansion (stride 0), so the recorded kernels are those of an unrecorded call."""
    calls = Calls()
    graphed = GraphedStep(calls, TapeRecorder())
    for x, y in batches(4, shape=(1, 3)):
        read_x, _, _ = graphed(x.expand(5, 3), y.expand(5))
    assert read_x.stride() == (0, 1) and read_x.shape == (5, 3)
    assert graphed.replays == 2


def test_an_input_off_alignment_is_recorded_as_far_off() -> None:
    """An env's share is a view of the batch at an offset, which need not fall on a
    64-byte boundary (vectors of 6 floats: 24 bytes a row), and a CPU's addmm rounds a
    misaligned input otherwise (found in the PPO update's minibatches): the recorded
    input sits as far off alignment as the tensor it was made from, so a replay equals
    the unrecorded call bit for bit."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(32, 6, generator=g), torch.randn(32, generator=g)

    def linear(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.addmm(bias, x, weight.t())

    graphed = GraphedStep(linear, TapeRecorder())
    for k in range(4):
        rows = torch.randn(64, generator=g)[2:20].view(3, 6)  # 8 bytes off alignment
        assert rows.data_ptr() % 64 != 0
        read_x, _, out = graphed(rows, torch.zeros(3))
        assert torch.equal(out, linear(rows, rows)), k
        assert read_x.data_ptr() % 64 == rows.data_ptr() % 64, k
    assert graphed.replays == 2


def test_a_recording_that_fails_is_reported_and_the_group_epoch_runs_unrecorded() -> None:
    """A host read in the step (a plugin's, say) cannot be recorded: the failure is
    handed on, the call and every later one run as they are (on that device, for the
    rest of the process), and no batch is lost."""
    total = torch.zeros(())

    def reads(x: torch.Tensor, y: torch.Tensor) -> None:
        total.add_(x.sum())
        if x.sum() > 1e9:  # a host read
            total.zero_()

    failures: list[BaseException] = []
    recorder = TapeRecorder()
    graphed = GraphedStep(reads, recorder, failures.append)
    data = batches(5)
    for x, y in data:
        graphed(x, y)
    assert len(failures) == 1 and isinstance(failures[0], HostReadWhileRecording)
    assert recorder.refused is failures[0]
    assert (graphed.unrecorded, graphed.recordings, graphed.replays) == (5, 0, 0)
    torch.testing.assert_close(total, sum(x.sum() for x, _ in data), rtol=1e-6, atol=1e-6)
    # The next group epoch on that device tries no recording, and says nothing more.
    later = GraphedStep(reads, recorder, failures.append)
    for x, y in data:
        later(x, y)
    assert len(failures) == 1 and (later.unrecorded, later.recordings) == (5, 0)


def test_a_failed_recording_warns_by_default() -> None:
    def reads(x: torch.Tensor, y: torch.Tensor) -> None:
        float(x.sum())

    graphed = GraphedStep(reads, TapeRecorder())
    with pytest.warns(RuntimeWarning, match="cuda_graphs: .*could not be recorded"):
        for x, y in batches(3):
            graphed(x, y)


# ------------------------------------------------------------- stacked epochs recorded
def run_recorded_and_not(
    make: Callable[[], list[GrowingHost]],
    loaders: tuple[DataLoader, DataLoader],
    epochs: int = 2,
    atol: float = 0.0,
    **training: object,
) -> tuple[list[GrowingHost], list[GrowingHost]]:
    """The same envs' epochs (stacked unless ``training`` names an engine) recorded and
    not: equal within ``atol``, figures and states (bit for bit on the tape, which runs
    the kernels the step runs, in its order)."""
    plain, recorded = make(), make()
    train, val = loaders
    training = {"engine": "stacked", **training}
    for _ in range(epochs):
        a = run_epoch(plain, train, val, HostTraining(**training))  # type: ignore[arg-type]
        b = run_epoch(
            recorded,
            train,
            val,
            HostTraining(cuda_graphs=True, **training),  # type: ignore[arg-type]
        )
        assert_close_results(a, b, atol=atol)
        assert a.stacked_predictions == b.stacked_predictions
    assert_close_states(plain, recorded, atol=atol)
    for env_a, env_b in zip(plain, recorded, strict=True):
        assert (env_a.probe is None) == (env_b.probe is None)
        if env_a.probe is not None and env_b.probe is not None:
            assert torch.equal(env_a.probe[0], env_b.probe[0])
    return plain, recorded


def test_recorded_stacked_epochs_equal_unrecorded_ones_for_seeds_in_every_stage(
    taped: list[TapeRecorder],
) -> None:
    """Incubation, blending at several alphas, gates, merged widenings, lone envs: six
    batches an epoch, so each group replays its step five times of six (the first group
    on the device four: its recorder warms up)."""
    run_recorded_and_not(cnn_envs, image_loaders(n_train=132, batch=22))
    assert len(taped) == 1  # one recorder a device
    replays_per_group_epoch(taped[0], batches=6)


def test_recorded_epochs_of_paired_groups_and_a_short_last_batch_equal_unrecorded_ones(
    taped: list[TapeRecorder],
) -> None:
    """Paired envs share one share (an expanded input); 100 samples in batches of 16
    leave a last batch of 4, which runs as it is."""
    run_recorded_and_not(
        lambda: cnn_envs()[:8], image_loaders(n_train=100, batch=16), paired_group=2
    )
    # 6 full batches (1 unrecorded, 5 replayed, the recorded one among them), 1 short
    replays_per_group_epoch(taped[0], batches=6)


def test_recorded_epochs_of_envs_of_different_widths_equal_unrecorded_ones(
    taped: list[TapeRecorder],
) -> None:
    run_recorded_and_not(envs_of_different_widths, image_loaders(n_train=140, batch=35))
    assert len(taped[0].recorded) == 2  # one group, 2 epochs
    replays_per_group_epoch(taped[0], batches=4)


@pytest.mark.parametrize("engine", ["per_env", "stacked"])
def test_recorded_epochs_of_envs_that_train_on_their_own_equal_unrecorded_ones(
    taped: list[TapeRecorder], engine: str
) -> None:
    """Each env's own step recorded once an epoch: the per-env engine's, and those of the
    envs a stacked epoch leaves alone (batches of 40 over 11 envs: envs 0-6 get 4 rows,
    7-10 get 3, so envs 0-5 and 8-9 stack and 6, 7 and 10 train alone); seeds in every
    stage, incubation and seed-gradient norms included: equal bit for bit."""
    run_recorded_and_not(
        cnn_envs, image_loaders(n_train=240, batch=40), engine=engine, cpu_workers=1
    )
    (recorder,) = taped
    recordings = len(recorder.recorded)
    assert recordings == 2 * (11 if engine == "per_env" else 2 + 3)  # 2 epochs
    # 6 batches; the warm-up once; an env's own step runs its first batch as it is each
    # epoch (it may make a seed's first momentum buffer), a group's only in the first.
    groups_recorded_at_once = 0 if engine == "per_env" else 2
    assert recorder.replays == 5 * recordings - 1 + groups_recorded_at_once


@pytest.mark.parametrize("engine", ["stacked", "per_env"])
def test_an_epochs_graphs_are_let_go_when_it_ends(
    taped: list[TapeRecorder], monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """A graph holds its memory pool (on a GPU, every activation of a step): a group's
    must go when the group is written back, an env's own when its epoch ends, without
    waiting for the cyclic garbage collector (each step refers back to its owner)."""
    made: list[weakref.ref[GraphedStep]] = []
    real_init = GraphedStep.__init__

    def noted(self: GraphedStep, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(weakref.ref(self))

    monkeypatch.setattr(GraphedStep, "__init__", noted)
    train, val = image_loaders(n_train=96, batch=16)
    envs = cnn_envs()[4:8]
    gc.disable()
    try:
        run_epoch(envs, train, val, HostTraining(engine=engine, cuda_graphs=True, cpu_workers=1))
        assert made and all(ref() is None for ref in made)
    finally:
        gc.enable()


def test_a_cpu_without_a_recorder_trains_as_it_would_without_graphs() -> None:
    """Off the GPU the setting changes nothing (no recorder for the CPU)."""
    run_recorded_and_not(lambda: cnn_envs()[4:8], image_loaders(n_train=96, batch=16), epochs=1)


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    # The same recorder for every input: nothing of the fixture's to reset between them.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(grown_envs())
def test_recorded_epochs_of_envs_grown_at_random_equal_unrecorded_ones(
    monkeypatch: pytest.MonkeyPatch, case: Grown
) -> None:
    """Any mix of seeds, stages, widths, batch splits and pairing (``tests/tolaria/grown``),
    with five batches an epoch."""
    run_drawn_case_recorded_and_not(monkeypatch, case)


def run_drawn_case_recorded_and_not(monkeypatch: pytest.MonkeyPatch, case: Grown) -> None:
    """``case``'s envs recorded on a fresh tape and not, in float64, on its batches and
    two more (five an epoch, so that steps replay)."""
    monkeypatch.setitem(step_graph.RECORDERS, "cpu", TapeRecorder)
    monkeypatch.setattr(step_graph, "_made", {})
    train, val = case.loaders()
    x, y = train.dataset.tensors  # type: ignore[attr-defined]
    more = torch.utils.data.TensorDataset(
        torch.cat([x, x[: 2 * case.batch]]), torch.cat([y, y[: 2 * case.batch]])
    )
    with float64_default():
        loaders = (DataLoader(more, batch_size=case.batch), val)
        run_recorded_and_not(case.envs, loaders, **case.training())


def test_a_fit_with_recorded_steps_equals_one_without(
    tmp_path: Path, taped: list[TapeRecorder]
) -> None:
    """``PPOModule(cuda_graphs=True)`` through ``Trainer.fit``: the same returns and the
    same policy, update for update (two envs of one host: one stacked group). Three
    recorders replayed: the host steps', and the PPO update's and the act's own."""
    plain, plain_returns = recorded_fit(tmp_path / "plain", 2, engine="stacked")
    recorded, recorded_returns = recorded_fit(
        tmp_path / "recorded", 2, engine="stacked", cuda_graphs=True
    )
    assert len(taped) == 3 and all(r.replays > 0 for r in taped)
    assert recorded_returns == plain_returns
    for name, value in plain.state_dict().items():
        assert torch.equal(value, recorded.state_dict()[name]), name


@pytest.mark.slow
@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(grown_envs(transformer=True))
def test_recorded_epochs_of_transformers_grown_at_random_equal_unrecorded_ones(
    monkeypatch: pytest.MonkeyPatch, case: Grown
) -> None:
    """Transformer hosts (never padded; seeds of every transformer blueprint), with five
    batches an epoch of tokens."""
    run_drawn_case_recorded_and_not(monkeypatch, case)


def test_a_recording_draws_no_random_number() -> None:
    """As a capture runs nothing, the tape's recording leaves the generator where it was:
    a step that draws noise, recorded then replayed, draws what eager steps draw."""
    noise = torch.zeros(3)

    def draws(x: torch.Tensor, y: torch.Tensor) -> None:
        noise.add_(torch.randn(3) + x.sum())

    torch.manual_seed(0)
    eager = torch.zeros(3)
    data = batches(4)
    for x, _ in data:
        eager.add_(torch.randn(3) + x.sum())
    torch.manual_seed(0)
    graphed = GraphedStep(draws, TapeRecorder())
    for x, y in data:
        graphed(x, y)
    assert graphed.replays == 2
    assert torch.equal(noise, eager)


# ------------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    "settings_, named",
    [({"compile": True}, "compile=true"), ({"amp": "fp16"}, "amp=fp16")],
)
def test_cuda_graphs_with_a_step_that_cannot_be_recorded_is_refused(
    settings_: dict[str, object], named: str
) -> None:
    for make in (HostTraining, EnvConfig):
        with pytest.raises(ConfigError, match=f"cuda_graphs.*{named}.*cuda_graphs to false"):
            make(cuda_graphs=True, engine="per_env", **settings_)  # type: ignore[arg-type]


def test_cuda_graphs_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs"):
        HostTraining(cuda_graphs="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("make", "training"),
    [
        (cnn_envs, {}),
        (lambda: cnn_envs()[:8], {"paired_group": 2}),
        (envs_of_different_widths, {}),
        (cnn_envs, {"engine": "per_env"}),
    ],
    ids=["every-stage", "paired", "widths", "per-env"],
)
def test_cuda_graphed_epochs_equal_unrecorded_ones(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], list[GrowingHost]],
    training: dict[str, object],
) -> None:
    """The real recorder replays the kernels the step launches: results within float32
    rounding of the unrecorded step's (stated: 1e-6; the same kernels should give the same
    bits, but cuDNN may choose its algorithms anew while capturing), TF32 off."""
    replays: list[int] = []
    real_record = step_graph.CudaGraphRecorder.record

    def counted(self: step_graph.CudaGraphRecorder, step: Callable[[], None]) -> Callable[[], None]:
        replay = real_record(self, step)

        def counting() -> None:
            replays.append(1)
            replay()

        return counting

    monkeypatch.setattr(step_graph.CudaGraphRecorder, "record", counted)

    loaders = image_loaders(n_train=132, batch=22)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        run_recorded_and_not(lambda: on_cuda(make), loaders, atol=1e-6, **training)
    assert replays, "no step was replayed from a CUDA graph"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_recording_that_reads_the_host_warns_and_the_device_stays_usable() -> None:
    """A capture that a host read invalidates must leave CUDA usable: the group epoch
    goes on unrecorded, every batch counted once."""
    device = torch.device("cuda")
    total = torch.zeros((), device=device)

    def reads(x: torch.Tensor, y: torch.Tensor) -> None:
        total.add_(x.sum())
        if float(x.sum()) > 1e9:  # a host read: capture fails here
            total.zero_()

    recorder = step_graph.CudaGraphRecorder(device)
    graphed = GraphedStep(reads, recorder)
    data = [(x.to(device), y.to(device)) for x, y in batches(5)]
    with pytest.warns(RuntimeWarning, match="could not be recorded"):
        for x, y in data:
            graphed(x, y)
    assert graphed.recordings == 0 and graphed.unrecorded == 5
    expected = sum(x.sum() for x, _ in data)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    torch.cuda.synchronize(device)  # no error left behind
