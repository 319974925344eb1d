"""The PPO update's minibatch passes recorded as CUDA graphs and replayed (``cuda_graphs``).

Why: an update is ``update_epochs * n_minibatches`` minibatch steps (20 by default), each
a few hundred small operators (the encoder, the fused LSTM, four masked heads, the losses
and their backward), every one a launch that a GPU's launching thread pays for while the
GPU waits: on an H100 a CUDA fit's PPO phase took 0.33-0.43 s an update at 16 envs (main
at 65f9830), 4 935 operators an update of the 14 447 a whole update launched at 56c086e
(benchmarks/README.md, "Stacked steps recorded as CUDA graphs"). Every update of a run
cuts its minibatches alike (the rollout's steps, the same count of envs at each place of
an epoch's shuffle), so one recording a place serves every update: its first minibatch
runs as it is, the next is recorded (the first recording after a warm-up on the
recorder's stream, once a run: :class:`_OwnWarmUp`), the rest replay.

What is recorded: the minibatch's forward, its losses and its gradients
(``torch.autograd.grad``), into the graph's tensors; the epoch's shuffle is gathered
before, as the eager update gathers it, into tensors the recordings read. What is not:
the backward pass the caller runs (Lightning's ``manual_backward``, with its hooks and a
precision plugin's loss scaling), which hands the recorded gradients to the parameters
(:class:`_RecordedGradients`, scaled by the gradient it receives: 1 unscaled), and the
gradient clipping and optimizer step, which stay eager (a fused Adam step is a few
kernels; Lightning counts optimizer steps and calls its hooks around each). So no hook
is skipped and the optimizer needs no ``capturable`` state; only a hook that walks the
loss's autograd graph finds one node where the eager loss has many.

A recording reads the policy's parameters where they are: the optimizer steps them in
place and a checkpoint's load copies into them, so it stays valid for the run. The
learning-rate schedule is the optimizer's (outside the graph); the entropy weight, which
anneals, is read from a device scalar that each call fills when it changes.

Layouts: a minibatch's place in the epoch's shuffle and its ``breaks`` (where an env's
chain of LSTM states breaks, which decides the replay's segments), the batch's shapes
being a run's. Minibatches of unbroken episodes share their place's layout; a governor
restore gives the envs it touched breaks of their own, so a minibatch holding one of them
has a layout of its own, which with many envs seldom comes again and then runs as it is.
Each layout gets its own recording, :data:`MAX_LAYOUTS` at most (the least recently used
is let go).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from esper.simic.ppo import PPOConfig, PPOLosses, minibatch_losses, total_loss
from esper.simic.ppo_batch import PPOBatch, split_bounds
from esper.tamiyo.policy import PolicyNetwork
from esper.tolaria.step_graph import GraphedStep, Layout, Recorder, tensor_layout

#: Layouts of a minibatch kept recorded at once. Unbroken minibatches are one layout;
#: those broken by governor restores are others, most seen once (they then hold no graph).
MAX_LAYOUTS = 8

#: ``PPOBatch.breaks``.
Breaks = tuple[tuple[int, ...], ...] | None


class _StepOutputs(NamedTuple):
    """A recorded minibatch step's outputs: the loss and the PPO terms (detached), and
    each trainable parameter's gradient (None where the loss does not reach it)."""

    loss: Tensor
    losses: PPOLosses
    grads: tuple[Tensor | None, ...]


class _RecordedGradients(torch.autograd.Function):
    """The loss as a node whose backward hands each parameter its recorded gradient,
    times the gradient the loss receives (1 from ``loss.backward()``, the scale under a
    loss scaler): one kernel for all of them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, loss: Tensor, grads: tuple[Tensor | None, ...], *params: Tensor
    ) -> Tensor:
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        present = [g for g in ctx.grads if g is not None]
        scaled = iter(torch._foreach_mul(present, grad_loss) if present else ())
        return (None, None, *(None if g is None else next(scaled) for g in ctx.grads))


class _OwnWarmUp:
    """``recorder`` with a warm-up of its own: the PPO pass's first recording is preceded
    by one eager pass on the recorder's stream even where host steps warmed the stream
    up already, since lazy set-ups of the policy's kernels (a cuDNN RNN's, cuBLAS's on
    that stream) belong outside a capture (torch's CUDA-graph notes). One eager
    minibatch a run; a recording's failure is still the recorder's (``refused``): PPOModule
    gives the update a recorder of its own (``step_graph.own_recorder``), so a failure
    here leaves the host steps recording."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self.warmed = False

    @property
    def refused(self) -> BaseException | None:
        return self._recorder.refused

    @refused.setter
    def refused(self, error: BaseException | None) -> None:
        self._recorder.refused = error

    def warm_up(self, step: Callable[[], None]) -> None:
        self._recorder.warm_up(step)
        self.warmed = True

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        return self._recorder.record(step)


class RecordedMinibatches:
    """:data:`~esper.simic.ppo.MinibatchPasses` of ``policy``, recorded per layout by
    ``recorder`` and replayed: ``ppo_update(..., minibatch_passes=this)``.

    Each epoch's shuffle of the batch is gathered, as the eager update gathers it, into
    tensors that stay put (``PPOBatch.select_envs_into``), and each minibatch's recording
    reads its envs' slice of them: the eager update's kernels on its values at its
    offsets from the start of an allocation, so its results bit for bit (tested on a CPU
    recorder that holds a step to a CUDA graph's rules, ``tests/tolaria/op_tape.py``).
    A recording that gathered its own rows into fresh memory differed in the last bit for
    one-env minibatches: the encoder's ``addmm`` rounds an input 8 bytes off a 64-byte
    boundary otherwise (``esper.tolaria.step_graph._placed_like``).
    """

    def __init__(self, policy: PolicyNetwork, config: PPOConfig, recorder: Recorder) -> None:
        self.policy = policy
        self.config = config
        self._recorder = _OwnWarmUp(recorder)
        self._params = tuple(p for p in policy.parameters() if p.requires_grad)
        if not self._params:
            raise ValueError("RecordedMinibatches: the policy has no trainable parameter")
        device = self._params[0].device
        #: The entropy weight the recorded steps read; filled when it changes.
        self._ent_coef = torch.zeros((), dtype=self._params[0].dtype, device=device)
        self._ent_coef_value: float | None = None
        #: The epoch's shuffled batch, which the recordings read.
        self._shuffled: tuple[Tensor, ...] = ()
        self._layout: list[Layout] = []
        self._steps: OrderedDict[Hashable, GraphedStep[_StepOutputs]] = OrderedDict()

    @property
    def steps(self) -> list[GraphedStep[_StepOutputs]]:
        """The layouts' recorded steps, least recently used first (for tests and benchmarks)."""
        return list(self._steps.values())

    def __call__(
        self, batch: PPOBatch, order: Tensor, ent_coef: float
    ) -> Iterator[tuple[PPOLosses, Tensor]]:
        if ent_coef != self._ent_coef_value:
            self._ent_coef.fill_(ent_coef)
            self._ent_coef_value = ent_coef
        self._shuffle(batch, order)
        breaks = batch.breaks_of(order)
        for a, b in split_bounds(order.shape[0], self.config.n_minibatches):
            mb_breaks = None if breaks is None else breaks[a:b]
            yield self._replayed((a, b), mb_breaks)

    def _shuffle(self, batch: PPOBatch, order: Tensor) -> None:
        """Gather the envs of ``order`` into the tensors the recordings read; where the
        batch's layout differs from the last one's (a run's batches share one), new
        tensors, and the recordings go."""
        tensors = batch.tensors()
        layout = [tensor_layout(t) for t in tensors]
        if layout != self._layout:
            self._shuffled, self._layout = tuple(torch.empty_like(t) for t in tensors), layout
            self._steps.clear()
        batch.select_envs_into(order, self._shuffled)

    def _replayed(self, envs: tuple[int, int], breaks: Breaks) -> tuple[PPOLosses, Tensor]:
        """The minibatch of the shuffled envs ``envs`` (start, end), recorded or replayed."""
        key = (envs, breaks)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= MAX_LAYOUTS:
                self._steps.popitem(last=False)
            step = GraphedStep(self._step_of(envs, breaks), self._recorder, _warn_unrecorded)
            self._steps[key] = step
        else:
            self._steps.move_to_end(key)
        (outputs,) = step()
        loss = _RecordedGradients.apply(outputs.loss, outputs.grads, *self._params)
        return outputs.losses, loss

    def _step_of(self, envs: tuple[int, int], breaks: Breaks) -> Callable[[], _StepOutputs]:
        """The device work of the minibatch of shuffled envs ``envs`` and ``breaks``:
        forward, losses, gradients; nothing read on the host."""
        a, b = envs

        def step() -> _StepOutputs:
            mb = PPOBatch.from_tensors([t[a:b] for t in self._shuffled], breaks)
            with torch.enable_grad():
                losses = minibatch_losses(self.policy, mb, self.config)
                loss = total_loss(losses, self._ent_coef, self.config)
                grads = torch.autograd.grad(loss, self._params, allow_unused=True)
            detached = PPOLosses(*(t.detach() for t in losses))
            return _StepOutputs(loss.detach(), detached, grads)

        return step


def _warn_unrecorded(error: BaseException) -> None:
    warnings.warn(
        f"cuda_graphs: a PPO minibatch step could not be recorded as a CUDA graph "
        f"({type(error).__name__}: {error}); the update's passes run as they are for the "
        "rest of this run. Results are unchanged; set cuda_graphs to false to keep from "
        "trying.",
        RuntimeWarning,
        stacklevel=4,
    )
