"""The policy: encoder MLP → LSTM → one masked categorical head per action head, plus a value.

One forward pass acts for every env at once. The heads are factored but autoregressive
through their masks *and* logits: the op is drawn first, then the slot from the row of
the slot logits and slot mask that belong to that op, then the blueprint from the row
that belongs to that slot. The rows are picked with ``gather`` on the device, so acting
makes no host read.

The log-prob and entropy of an action cover only the heads its op uses
(``ActionSchema.head_usage()``), so a WAIT is not credited or blamed for a slot it
never touched.

Hidden state is ``(h, c)``, each ``[lstm_layers, E, hidden_size]``. Both :meth:`act`
and :meth:`evaluate` zero it for an env whose step starts a new episode, before that
step's LSTM update, and :meth:`evaluate` takes the stored state at the steps a governor
restore flagged, so the update replays what the rollout computed: exactly, step by step,
or within float rounding in one fused LSTM call over the unbroken stretches of states.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from esper.contracts import ActionSchema, LifecycleOp
from esper.contracts.config_errors import owned_by, require_int, require_number
from esper.tamiyo.action_masks import ActionMasks, select_row
from esper.tamiyo.distributions import MaskedCategorical, padded_heads
from esper.tamiyo.replay_segments import replay_in_segments

#: ``(h, c)``, each ``[lstm_layers, E, hidden_size]``.
LSTMState = tuple[Tensor, Tensor]

#: Position of each head in an action vector, following ``contracts.actions.HEAD_NAMES``.
OP, SLOT, BLUEPRINT, BLEND = range(4)


@dataclass(frozen=True)
class PolicyConfig:
    """Sizes and init gains of :class:`PolicyNetwork`.

    The gains follow CleanRL: ``sqrt(2)`` for hidden layers, a small gain for the policy
    heads so the first policy is close to uniform over the legal choices, 1 for the value.

    Attributes:
        hidden_size: width of the encoder layers and of the LSTM state; larger gives the
            policy more capacity at more cost per step.
        lstm_layers: stacked LSTM cells the policy steps through once per decision.
        encoder_layers: Linear + Tanh layers between the observation and the LSTM.
        hidden_init_gain: gain of the orthogonal initialisation of the encoder layers.
        policy_head_init_gain: gain of the orthogonal initialisation of the action heads;
            small, so the first policy is close to uniform over the legal choices.
        value_head_init_gain: gain of the orthogonal initialisation of the value head.
        prune_logit_init: initial bias of the PRUNE op's logit: 0 starts uniform, below 0
            makes pruning rarer at first so seeds live long enough to be judged.
        cpu_threads: intra-op threads for the policy's act, value and PPO update on the
            CPU (``esper.threads``); null keeps torch's count. Raise it for a policy
            large enough to keep more cores busy.
    """

    hidden_size: int = 128
    lstm_layers: int = 1
    encoder_layers: int = 2
    hidden_init_gain: float = math.sqrt(2.0)
    policy_head_init_gain: float = 0.01
    value_head_init_gain: float = 1.0
    #: Initial bias of the PRUNE op's logit. Pruning throws away what a seed has learned;
    #: a uniform first policy prunes a live seed about one step in three, so few seeds
    #: live long enough to show what they add. Starting below the other ops lets seeds
    #: be judged, and PPO raises it where pruning pays. 0 gives the uniform start; -2
    #: makes PRUNE about 7 times less likely than each other op (benchmarks/README.md).
    prune_logit_init: float = -2.0
    #: One thread: the policy acts on a row per env, and a second thread, asleep through
    #: each host epoch, stalls the next act while it wakes (``esper.threads``).
    cpu_threads: int | None = 1

    def __post_init__(self) -> None:
        with owned_by(self):
            if self.cpu_threads is not None:
                require_int("cpu_threads", self.cpu_threads, 1, hint="or null for torch's count")
            for name in ("hidden_size", "lstm_layers", "encoder_layers"):
                require_int(name, getattr(self, name), 1)
            for name in ("hidden_init_gain", "policy_head_init_gain", "value_head_init_gain"):
                require_number(name, getattr(self, name), above=0.0)
            require_number(
                "prune_logit_init",
                self.prune_logit_init,
                hint="0 starts uniform, below 0 makes PRUNE rarer at first",
            )


@dataclass(frozen=True)
class ActResult:
    """What :meth:`PolicyNetwork.act` returns for ``E`` envs; every field stays on the device."""

    actions: Tensor  # [E, 4] long, in HEAD_NAMES order
    log_prob: Tensor  # [E], over the heads the chosen op uses
    entropy: Tensor  # [E], over the same heads
    value: Tensor  # [E]
    hidden: LSTMState  # after this step


@dataclass(frozen=True)
class _HeadsOut:
    actions: Tensor  # [*B, 4]
    log_prob: Tensor  # [*B]
    entropy: Tensor  # [*B]


def _layer_init(layer: nn.Linear, gain: float) -> nn.Linear:
    """Orthogonal weights and zero bias, as CleanRL's ``layer_init``."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _reset_hidden(hidden: LSTMState, episode_starts: Tensor) -> LSTMState:
    """Zero the state of envs whose step starts an episode; ``episode_starts`` is ``[E]`` bool.

    ``where`` rather than a multiply, so a non-finite state left by a failed episode is
    cleared too.
    """
    keep = ~episode_starts.view(1, -1, 1)
    return tuple(torch.where(keep, s, 0.0) for s in hidden)  # type: ignore[return-value]


class PolicyNetwork(nn.Module):
    """Recurrent actor-critic over the factored, masked action space of ``schema``."""

    def __init__(
        self, obs_dim: int, schema: ActionSchema, config: PolicyConfig | None = None
    ) -> None:
        super().__init__()
        if obs_dim < 1:
            raise ValueError(f"PolicyNetwork: obs_dim must be >= 1, got {obs_dim}")
        self.config = config = config or PolicyConfig()
        self.schema = schema
        hidden = config.hidden_size
        self.n_ops, self.n_slots, self.n_blueprints, self.n_blends = (h.size for h in schema.heads)

        layers: list[nn.Module] = []
        width = obs_dim
        for _ in range(config.encoder_layers):
            layers += [_layer_init(nn.Linear(width, hidden), config.hidden_init_gain), nn.Tanh()]
            width = hidden
        self.encoder = nn.Sequential(*layers)

        # One cell per layer rather than nn.LSTM: the policy always steps one time step at
        # a time, and torch.compile traces cells without a graph break (it cannot trace
        # nn.LSTM).
        self.lstm = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(config.lstm_layers))
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.zeros_(param)
            else:
                nn.init.orthogonal_(param, 1.0)

        # The slot head has one row of logits per op and the blueprint head one per slot,
        # the same shapes as their masks, so the earlier choice selects both together.
        gain = config.policy_head_init_gain
        self.op_head = _layer_init(nn.Linear(hidden, self.n_ops), gain)
        with torch.no_grad():
            self.op_head.bias[int(LifecycleOp.PRUNE)] = config.prune_logit_init
        self.slot_head = _layer_init(nn.Linear(hidden, self.n_ops * self.n_slots), gain)
        self.blueprint_head = _layer_init(nn.Linear(hidden, self.n_slots * self.n_blueprints), gain)
        self.blend_head = _layer_init(nn.Linear(hidden, self.n_blends), gain)
        self.value_head = _layer_init(nn.Linear(hidden, 1), config.value_head_init_gain)

        usage = torch.tensor(ActionSchema.head_usage(), dtype=torch.bool)  # [n_ops, 4]
        self.register_buffer("head_usage", usage, persistent=False)

    def initial_state(self, n_envs: int, device: torch.device | str | None = None) -> LSTMState:
        """Zero ``(h, c)``, each ``[lstm_layers, n_envs, hidden_size]``."""
        shape = (self.config.lstm_layers, n_envs, self.config.hidden_size)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    # ------------------------------------------------------------------ acting
    @torch.no_grad()
    def act(
        self,
        obs: Tensor,
        hidden: LSTMState,
        masks: ActionMasks,
        deterministic: bool = False,
        episode_starts: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> ActResult:
        """One step for all envs: ``obs [E, D]``, masks with batch shape ``[E]``.

        ``episode_starts [E]`` bool, when given, zeroes those envs' state first (pass the
        same flags that go into the buffer). ``deterministic`` takes each head's most
        likely legal choice instead of sampling. No host reads.
        """
        features, hidden = self._recur(self.encoder(obs), hidden, episode_starts)
        heads = self._heads(features, masks, deterministic=deterministic, generator=generator)
        value = self.value_head(features).squeeze(-1)
        return ActResult(heads.actions, heads.log_prob, heads.entropy, value, hidden)

    # -------------------------------------------------------------- evaluating
    def evaluate(
        self,
        obs: Tensor,
        hidden0: LSTMState,
        masks: ActionMasks,
        actions: Tensor,
        episode_starts: Tensor,
        hidden_restarts: Tensor | None = None,
        stored_hidden: LSTMState | None = None,
        breaks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Replay stored sequences: ``obs [E, T, D]``, masks ``[E, T, ...]``, ``actions [E, T, 4]``.

        ``hidden0`` is the state before step 0; ``episode_starts [E, T]`` bool zeroes the
        state before the flagged steps, exactly as :meth:`act` did. A governor restore
        breaks an env's chain of states (its kept transition and the one after it acted
        from stored states, not from the previous step's output), so ``hidden_restarts
        [E, T]`` bool, given with ``stored_hidden`` (``(h, c)`` each ``[E, T, layers, H]``,
        the state each step acted from), makes a flagged step start from its stored state,
        before the episode reset, as the rollout passed it to :meth:`act`. A ``where`` per
        step: no host read. Returns ``(log_prob, entropy, value)``, each ``[E, T]``, with
        gradients.

        ``breaks`` is the caller's word (host-side: the buffer knows it) of where each
        env's chain of states breaks: per env, the steps after step 0 that start an
        episode or are flagged in ``hidden_restarts`` (``PPOBatch.breaks``); None claims
        nothing. Given it, the LSTM replays whole sequences, or the unbroken segments
        between breaks, each from its stored state (``stored_hidden``;
        ``esper.tamiyo.replay_segments``), in one fused call (:meth:`_recur_sequence`)
        instead of a Python step loop: the same function, rounded differently (about 1e-7
        on a CPU; on CUDA cuDNN's RNN computes in TF32 unless
        ``torch.backends.cudnn.rnn.fp32_precision`` says otherwise, so about 1e-3 there,
        which PPO's clipping absorbs), in a few kernels where the loop launched about 45 a
        step, forward and backward.
        """
        if (hidden_restarts is None) != (stored_hidden is None):
            raise ValueError("evaluate: pass hidden_restarts and stored_hidden together")
        x = self.encoder(obs)  # [E, T, H]
        if breaks is not None and not any(breaks):  # step 0's reset, then no other
            features = self._recur_sequence(x, _reset_hidden(hidden0, episode_starts[:, 0]))
        elif breaks is not None:
            if stored_hidden is None:
                raise ValueError("evaluate: breaks need stored_hidden, the states to restart from")
            features = replay_in_segments(
                lambda rows, start, resets: self._recur_sequence(
                    rows, _reset_hidden(start, resets)
                ),
                x,
                stored_hidden,
                episode_starts,
                breaks,
            )
        else:
            hidden = hidden0
            steps = []
            for t in range(x.shape[1]):
                if hidden_restarts is not None and stored_hidden is not None:
                    restart = hidden_restarts[:, t].view(1, -1, 1)
                    hidden = tuple(  # type: ignore[assignment]
                        torch.where(restart, stored[:, t].transpose(0, 1), state)
                        for stored, state in zip(stored_hidden, hidden, strict=True)
                    )
                out, hidden = self._recur(x[:, t], hidden, episode_starts[:, t])
                steps.append(out)
            features = torch.stack(steps, dim=1)  # [E, T, H]
        heads = self._scored_heads(features, masks, actions)
        return heads.log_prob, heads.entropy, self.value_head(features).squeeze(-1)

    def value(self, obs: Tensor, hidden: LSTMState, episode_starts: Tensor | None = None) -> Tensor:
        """Critic only, ``[E]``: for bootstrapping truncated episodes in one batched pass."""
        features, _ = self._recur(self.encoder(obs), hidden, episode_starts)
        return self.value_head(features).squeeze(-1)

    # ---------------------------------------------------------------- internals
    def _recur(
        self, x: Tensor, hidden: LSTMState, episode_starts: Tensor | None
    ) -> tuple[Tensor, LSTMState]:
        """One LSTM step: ``x [E, H]`` → ``([E, H], new hidden)``."""
        if episode_starts is not None:
            hidden = _reset_hidden(hidden, episode_starts)
        h, c = hidden
        hs, cs = [], []
        for layer, cell in enumerate(self.lstm):
            h_l, c_l = cell(x, (h[layer], c[layer]))
            hs.append(h_l)
            cs.append(c_l)
            x = h_l
        return x, (torch.stack(hs), torch.stack(cs))

    def _recur_sequence(self, x: Tensor, hidden: LSTMState) -> Tensor:
        """The LSTM over whole sequences, ``x [E, T, H]`` from ``hidden`` → ``[E, T, H]``:
        :meth:`_recur` at every step with no reset between, as one ``torch.lstm`` call on
        the cells' own parameters (oneDNN on a CPU, cuDNN on CUDA)."""
        params = [
            p
            for cell in self.lstm
            for p in (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        ]
        with warnings.catch_warnings():
            # cuDNN copies weights that are not one contiguous block (the cells' are four
            # tensors each) into one for the call, and says so; a few copies per call.
            warnings.filterwarnings("ignore", message="RNN module weights are not part")
            out, _, _ = torch.lstm(
                x,
                hidden,
                params,
                True,  # has biases
                len(self.lstm),
                0.0,  # dropout
                self.training,
                False,  # bidirectional
                True,  # batch first
            )
        return out

    def _heads(
        self,
        features: Tensor,
        masks: ActionMasks,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
    ) -> _HeadsOut:
        """Draw each head in order (the slot's row is the op's, the blueprint's the
        slot's); ``features [*B, H]``."""

        def choose(dist: MaskedCategorical) -> Tensor:
            return dist.mode() if deterministic else dist.sample(generator)

        op_dist = MaskedCategorical(self.op_head(features), masks.op)
        op = choose(op_dist)

        slot_logits = self.slot_head(features).unflatten(-1, (self.n_ops, self.n_slots))
        slot_dist = MaskedCategorical(select_row(slot_logits, op), select_row(masks.slot, op))
        slot = choose(slot_dist)

        blueprint_logits = self.blueprint_head(features).unflatten(
            -1, (self.n_slots, self.n_blueprints)
        )
        blueprint_dist = MaskedCategorical(
            select_row(blueprint_logits, slot), select_row(masks.blueprint, slot)
        )
        blueprint = choose(blueprint_dist)

        blend_dist = MaskedCategorical(self.blend_head(features), masks.blend)
        blend = choose(blend_dist)

        chosen = torch.stack((op, slot, blueprint, blend), dim=-1)  # [*B, 4]
        dists = (op_dist, slot_dist, blueprint_dist, blend_dist)
        used = self.head_usage[op]  # [*B, 4]: the heads this op uses

        def over_used_heads(per_head: Callable[[MaskedCategorical, Tensor], Tensor]) -> Tensor:
            values = torch.stack([per_head(d, chosen[..., i]) for i, d in enumerate(dists)], -1)
            return torch.where(used, values, 0.0).sum(dim=-1)

        return _HeadsOut(
            actions=chosen,
            log_prob=over_used_heads(lambda d, a: d.log_prob(a)),
            entropy=over_used_heads(lambda d, a: d.entropy()),
        )

    def _scored_heads(self, features: Tensor, masks: ActionMasks, actions: Tensor) -> _HeadsOut:
        """What :meth:`_heads` gives for ``actions [*B, 4]`` had it drawn them: the log-prob
        and entropy of the heads each op uses, summed. With every choice known no head
        waits for another's draw, so the four score as one padded categorical
        (:func:`~esper.tamiyo.distributions.padded_heads`). A PPO update scores every
        minibatch this way, ten epochs of them: ``benchmarks/ppo_update.py --n-envs 16
        --episode-epochs 8`` counted 6 224 kernel operators an update with a categorical
        per head, 5 124 padded."""
        op, slot = actions[..., OP], actions[..., SLOT]
        slot_logits = self.slot_head(features).unflatten(-1, (self.n_ops, self.n_slots))
        blueprint_logits = self.blueprint_head(features).unflatten(
            -1, (self.n_slots, self.n_blueprints)
        )
        dist = padded_heads(
            (
                self.op_head(features),
                select_row(slot_logits, op),
                select_row(blueprint_logits, slot),
                self.blend_head(features),
            ),
            (
                masks.op,
                select_row(masks.slot, op),
                select_row(masks.blueprint, slot),
                masks.blend,
            ),
        )
        used = self.head_usage[op]  # [*B, 4]: the heads this op uses
        return _HeadsOut(
            actions=actions,
            log_prob=torch.where(used, dist.log_prob(actions), 0.0).sum(dim=-1),
            entropy=torch.where(used, dist.entropy(), 0.0).sum(dim=-1),
        )
