"""The policy's act recorded as a CUDA graph and replayed for the rest of a run (``cuda_graphs``).

Why: a rollout step's act (the encoder, an LSTM step, four masked heads drawn in order,
the value) is about a hundred small operators for all envs at once, each a launch that a
GPU's launching thread pays for: 812 of the 10 166 an update launched on side_by_side's
16-env work with the host steps and the PPO update recorded (benchmarks/README.md). Every
step of a run acts on tensors of one layout (the run's envs), on the policy's parameters
where they are (the optimizer steps them in place; a learner copy and a checkpoint's load
copy into them), so one recording serves the run: its first act runs as it is, the next
warms this recorder's stream up, the next is recorded, and every later one replays.

The draws: ``MaskedCategorical.sample`` draws its noise from the default generator, which
a CUDA graph replays from the generator's current offset and then advances, as an eager
draw does, so replayed acts draw what eager ones draw (on a CPU the tests' tape replays
the draw itself). A caller that passes a generator of its own, or ``episode_starts``, gets
the policy's act as it is; so does an act under a caller's autocast, whose cache of cast
weights a recording cannot hold (a fit's rollout runs outside the trainer's autocast).

A replay's outputs are the recording's tensors, which the next replay overwrites, and the
rollout keeps them (the store, the governor's snapshot of the state an env acted from, the
next step's hidden state), so each replayed act hands back copies: six copies a step.

The recorder is one of its own, not the host steps' (``step_graph.own_recorder``): a
recording that fails here (a plugin policy that reads the device on the host) warns, and
the act runs as it is for the rest of the run, while host steps keep recording.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import ActResult, LSTMState, PolicyNetwork
from esper.tolaria.step_graph import GraphedStep, Recorder

#: What a recorded act returns: actions, log-prob, entropy, value, h, c.
_ActOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


class RecordedAct:
    """``policy.act`` (its signature), recorded by ``recorder`` per ``deterministic`` and
    replayed; see the module docstring."""

    def __init__(self, policy: PolicyNetwork, recorder: Recorder) -> None:
        self.policy = policy
        self._recorder = recorder
        #: Per ``deterministic``, its recorded step.
        self.steps: dict[bool, GraphedStep[_ActOutputs]] = {}

    def __call__(
        self,
        obs: Tensor,
        hidden: LSTMState,
        masks: ActionMasks,
        deterministic: bool = False,
        episode_starts: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> ActResult:
        if (
            episode_starts is not None
            or generator is not None
            or torch.is_autocast_enabled(obs.device.type)
        ):
            return self.policy.act(obs, hidden, masks, deterministic, episode_starts, generator)
        step = self.steps.get(deterministic)
        if step is None:
            step = self.steps[deterministic] = GraphedStep(
                lambda *inputs: self._act(deterministic, *inputs),
                self._recorder,
                _warn_act_unrecorded,
            )
        replays = step.replays
        *_, outputs = step(obs, *hidden, masks.op, masks.slot, masks.blueprint, masks.blend)
        if step.replays != replays:  # the recording's tensors: the next replay overwrites them
            outputs = tuple(t.clone() for t in outputs)
        actions, log_prob, entropy, value, h, c = outputs
        return ActResult(actions, log_prob, entropy, value, (h, c))

    def _act(
        self,
        deterministic: bool,
        obs: Tensor,
        h: Tensor,
        c: Tensor,
        op: Tensor,
        slot: Tensor,
        blueprint: Tensor,
        blend: Tensor,
    ) -> _ActOutputs:
        masks = ActionMasks(op=op, slot=slot, blueprint=blueprint, blend=blend)
        act = self.policy.act(obs, (h, c), masks, deterministic=deterministic)
        return (act.actions, act.log_prob, act.entropy, act.value, *act.hidden)


def _warn_act_unrecorded(error: BaseException) -> None:
    warnings.warn(
        f"cuda_graphs: the policy's act could not be recorded as a CUDA graph "
        f"({type(error).__name__}: {error}); it runs as it is for the rest of this run "
        "(host steps still record). Results are unchanged.",
        RuntimeWarning,
        stacklevel=3,
    )
