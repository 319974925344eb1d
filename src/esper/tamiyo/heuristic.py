"""A hand-written controller: the baseline a trained policy has to beat.

:class:`HeuristicController` has the acting interface of
:class:`~esper.tamiyo.policy.PolicyNetwork` (``initial_state``, ``act``, ``value``), so
the rollout loop (``esper.mdp.rollout.RolloutCollector``) drives it unchanged and its
episodes are scored by the same rewards and telemetry as the policy's. Its rules, in
priority order, for every env at once:

1. **PRUNE** the first slot whose seed is BLENDING or HOLDING and whose counterfactual
   contribution is below ``-prune_threshold``: a seed the host is better off without.
2. **ADVANCE** (fossilize) the first slot where ADVANCE is legal and its last advance
   was not refused by a gate. The masks offer ADVANCE only for a seed that has held long
   enough (the env's clock carries seeds to HOLDING); whether it *should* pass is the
   contribution gate's job, not the controller's.
3. **GERMINATE** when the host has plateaued (``val_acc_delta < plateau_delta``) early
   enough in the episode (``epoch_fraction < max_germinate_fraction``) and, where
   ``germinate_at`` lists epoch fractions, at one of them, on the first slot where it
   is legal, with the most preferred legal blueprint and the configured blend mode.
   With a ``germinate_at`` schedule this rule outranks rule 2: a planting the schedule
   misses is never made up, while a fossilize put off by one epoch only waits (the
   seed keeps its alpha of 1 in HOLDING). Without one the order is as listed.
4. **ADVANCE** a slot whose last advance was refused (``retry_refused_advance``): the
   env keeps a slot's refusal flag until an advance passes, and a contribution too small
   today may be enough after another epoch, so without a retry a seed refused once
   would never fossilize.
5. **WAIT** otherwise.

Everything runs on the device with ``where``/``gather``/``argmax`` over masked integer
scores: no host reads, whatever the number of envs. Every action it returns is legal
under the masks it was given.

**Raw observations.** It reads the features as ``esper.tamiyo.features`` builds them
(fractions of accuracy and of the episode, 0/1 stage one-hots and refusal flags), not
the normalised view the policy learns from: its thresholds are in those units, so a
rollout must hand it the raw observation (``esper.evaluation.episodes.run_episodes`` does,
with ``normalize=None``). Comparing raw features with raw thresholds is exact; pushing
the thresholds through the policy's running normaliser instead, as it once did, lost
the comparisons the normaliser's clip flattened.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from esper.contracts import ActionSchema, BlendMode, LifecycleOp, ObservationLayout, SeedStage
from esper.contracts.config_errors import (
    ConfigError,
    owned_by,
    require_bool,
    require_number,
)
from esper.tamiyo.action_masks import ActionMasks, select_row
from esper.tamiyo.policy import ActResult, LSTMState
from esper.tamiyo.stateless import StatelessController

#: A binary observation feature (stage one-hot, refusal flag) is set iff it exceeds this:
#: the features are exactly 0 or 1, and halfway reads either without a tie.
BINARY_THRESHOLD = 0.5

#: ``epoch_fraction`` matches a ``germinate_at`` entry within this. The observation holds
#: ``host_epoch / episode_epochs`` in float32 (rounding error below 1e-7); one epoch of
#: an episode of up to 5 000 epochs is at least 2e-4 apart from the next, so each entry
#: matches exactly one host epoch.
GERMINATE_AT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class HeuristicConfig:
    """The thresholds and preferences of :class:`HeuristicController`.

    Accuracies and contributions are fractions (0.01 = one percentage point of
    validation accuracy), as in the observation.
    """

    #: Prune a blending/holding seed whose contribution is below minus this: a seed
    #: costing more than this much validation accuracy is hurting the host.
    prune_threshold: float = 0.01
    #: The host has plateaued when its validation accuracy rose by less than this in the
    #: last epoch: the moment extra capacity is worth planting.
    plateau_delta: float = 0.005
    #: Germinate only while ``epoch_fraction`` is below this. With the default
    #: lifecycle a seed needs about 4 epochs (germinate, 1 training, 1 blending,
    #: 1 holding) to fossilize; a seed planted late has few epochs left to pay for itself.
    max_germinate_fraction: float = 0.7
    #: Blueprint names, most preferred first; the first legal one in this order is
    #: planted, else the first legal blueprint in the schema's order.
    blueprint_preference: tuple[str, ...] = ()
    #: How a planted seed is blended in; the first legal mode if this one is masked.
    blend_mode: BlendMode = BlendMode.LINEAR
    #: Retry a refused ADVANCE when nothing better is to do (rule 4 in the module docs).
    retry_refused_advance: bool = True
    #: Epoch fractions (``host_epoch / episode_epochs``, as the observation's
    #: ``epoch_fraction``) at which germination is allowed; empty allows it at any epoch.
    #: A fixed schedule (``esper.tamiyo.periodic``) plants at these and nowhere else.
    germinate_at: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        with owned_by(self):
            require_number(
                "prune_threshold",
                self.prune_threshold,
                at_least=0,
                hint="seeds are pruned below minus it",
            )
            require_number("plateau_delta", self.plateau_delta)
            require_number(
                "max_germinate_fraction",
                self.max_germinate_fraction,
                above=0,
                at_most=1,
                hint="a fraction of the episode",
            )
            names = self.blueprint_preference
            if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                raise ConfigError(
                    "blueprint_preference", f"must be a tuple of blueprint names, got {names!r}"
                )
            if len(set(names)) != len(names):
                raise ConfigError("blueprint_preference", f"names one twice: {names}")
            if isinstance(self.blend_mode, bool) or self.blend_mode not in set(BlendMode):
                raise ConfigError(
                    "blend_mode", f"must be one of {list(BlendMode)}, got {self.blend_mode!r}"
                )
            require_bool("retry_refused_advance", self.retry_refused_advance)
            self._check_germinate_at()

    def _check_germinate_at(self) -> None:
        fractions = self.germinate_at
        if not isinstance(fractions, tuple):
            raise ConfigError(
                "germinate_at", f"must be a tuple of epoch fractions, got {fractions!r}"
            )
        for i, fraction in enumerate(fractions):
            require_number(
                f"germinate_at[{i}]",
                fraction,
                at_least=0,
                below=self.max_germinate_fraction,
                hint="an epoch fraction host_epoch / episode_epochs below "
                "max_germinate_fraction (a later one never fires)",
            )
        ordered = sorted(fractions)
        if any(b - a <= 2 * GERMINATE_AT_TOLERANCE for a, b in itertools.pairwise(ordered)):
            raise ConfigError(
                "germinate_at",
                f"names one epoch twice: {fractions}; list each epoch fraction once",
            )


#: The scripted grower: plants the preferred blueprint in every slot from the first
#: decision, lets the clock carry each seed to HOLDING, fossilizes as soon as the gate
#: allows, never prunes. It answers "can growth pay here at all?" without any learning:
#: ``benchmarks/growth.py`` sets it against no growth. conv_heavy is the blueprint that
#: paid most on the small digits hosts (see benchmarks/README.md); mlp is the
#: Transformer's counterpart.
SCRIPTED_GROWTH = HeuristicConfig(
    prune_threshold=1.0,  # contributions are fractions in [-1, 1]: never below -1
    plateau_delta=1.0,  # an epoch never gains a whole unit of accuracy: always "plateaued"
    max_germinate_fraction=0.3,
    blueprint_preference=("conv_wide", "conv_heavy", "mlp"),
)


def preferring_what_fits(config: HeuristicConfig, schema: ActionSchema) -> HeuristicConfig:
    """``config`` with its blueprint preference cut to the blueprints ``schema`` offers.

    A preference written for every host kind (:data:`SCRIPTED_GROWTH` names the CNN's and
    the Transformer's blueprints) names some that a given host lacks; the controller
    itself refuses unknown names, so that a user's own preference with a typo fails loud.
    """
    kept = tuple(n for n in config.blueprint_preference if n in schema.blueprint_names)
    return dataclasses.replace(config, blueprint_preference=kept)


def _first_true(mask: Tensor, scores: Tensor) -> Tensor:
    """Index of the highest-scoring True entry of ``mask [..., K]``; ``scores [K]`` are > 0.

    An all-False row gives the highest-scoring index overall, so an unused head still
    gets the preferred choice. No host read.
    """
    usable = mask | ~mask.any(-1, keepdim=True)
    return torch.where(usable, scores, -1).argmax(-1)


def _preference_scores(order: list[int]) -> Tensor:
    """``[K]`` long scores, highest for ``order[0]``, so ``argmax`` picks by preference."""
    scores = torch.empty(len(order), dtype=torch.long)
    for rank, index in enumerate(order):
        scores[index] = len(order) - rank
    return scores


class HeuristicController(StatelessController):
    """Rule-based controller with :class:`~esper.tamiyo.policy.PolicyNetwork`'s acting API.

    It has no trainable parameters: ``log_prob``, ``entropy`` and ``value`` are zeros,
    and the placeholder recurrent state is passed through unchanged.
    ``deterministic``, ``generator`` and ``episode_starts`` are accepted and ignored: the
    rules are deterministic and stateless.

    Args:
        layout: where each feature sits in the observation.
        schema: the action heads; gives the blueprint names and blend modes.
        config: thresholds and preferences, in the raw features' units.
    """

    # Column indices and scores, as non-persistent buffers so they follow ``.to(device)``.
    _contribution: Tensor
    _gate_refused: Tensor
    _germinated: Tensor
    _blending: Tensor
    _holding: Tensor
    _slot_scores: Tensor
    _blueprint_scores: Tensor
    _blend_scores: Tensor
    _germinate_at: Tensor

    def __init__(
        self,
        layout: ObservationLayout,
        schema: ActionSchema,
        config: HeuristicConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config = config or HeuristicConfig()
        self.layout = layout
        self.schema = schema
        n_slots, n_blueprints = len(schema.slot_ids), len(schema.blueprint_names)
        if (layout.n_slots, layout.n_blueprints) != (n_slots, n_blueprints):
            raise ValueError(
                f"layout has {layout.n_slots} slots and {layout.n_blueprints} blueprints, "
                f"schema {n_slots} and {n_blueprints}; build both for the same host"
            )
        unknown = [n for n in config.blueprint_preference if n not in schema.blueprint_names]
        if unknown:
            raise ValueError(
                f"HeuristicConfig.blueprint_preference names {unknown}, not in this schema's "
                f"blueprints {list(schema.blueprint_names)}"
            )
        if config.blend_mode not in schema.blend_modes:
            raise ValueError(
                f"HeuristicConfig.blend_mode {config.blend_mode!r} is not one of the schema's "
                f"blend modes {list(schema.blend_modes)}"
            )

        def columns(feature: str, offset: int = 0) -> Tensor:
            starts = [layout[f"slot{s}.{feature}"].start + offset for s in range(n_slots)]
            return torch.tensor(starts, dtype=torch.long)

        self._epoch_fraction = layout["epoch_fraction"].start
        self._val_acc_delta = layout["val_acc_delta"].start
        stage = {s: columns("stage", int(s)) for s in SeedStage}

        preferred = [schema.blueprint_names.index(n) for n in config.blueprint_preference]
        blueprint_order = preferred + [b for b in range(n_blueprints) if b not in preferred]
        blend = schema.blend_modes.index(config.blend_mode)
        blend_order = [blend] + [m for m in range(len(schema.blend_modes)) if m != blend]
        # First slot first: the highest score goes to slot 0.
        slot_order = list(range(n_slots))

        buffers = {
            "_contribution": columns("contribution"),
            "_gate_refused": columns("gate_refused"),
            "_germinated": stage[SeedStage.GERMINATED],
            "_blending": stage[SeedStage.BLENDING],
            "_holding": stage[SeedStage.HOLDING],
            "_slot_scores": _preference_scores(slot_order),
            "_blueprint_scores": _preference_scores(blueprint_order),
            "_blend_scores": _preference_scores(blend_order),
            "_germinate_at": torch.tensor(config.germinate_at, dtype=torch.float32),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)

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
        """One rule-based action per env: raw ``obs [E, D]``, masks with batch shape ``[E]``.

        Returns actions ``[E, 4]`` in (op, slot, blueprint, blend) order, legal under
        ``masks``; zero log-prob, entropy and value; ``hidden`` unchanged. No host reads.
        """
        self._check(obs, masks)
        ops, config = masks.op, self.config

        def is_set(cols: Tensor) -> Tensor:
            return obs.index_select(-1, cols) > BINARY_THRESHOLD

        prunable = (
            (obs.index_select(-1, self._contribution) < -config.prune_threshold)
            & (is_set(self._blending) | is_set(self._holding))
            & masks.slot[:, LifecycleOp.PRUNE]
            & ops[:, LifecycleOp.PRUNE, None]
        )
        can_advance = masks.slot[:, LifecycleOp.ADVANCE] & ops[:, LifecycleOp.ADVANCE, None]
        advanceable = can_advance & (~is_set(self._gate_refused) | is_set(self._germinated))
        fraction = obs[:, self._epoch_fraction]
        when = (fraction < config.max_germinate_fraction) & (
            obs[:, self._val_acc_delta] < config.plateau_delta
        )
        if config.germinate_at:  # a Python tuple: no host read
            distance = (fraction[:, None] - self._germinate_at).abs()
            when = when & (distance <= GERMINATE_AT_TOLERANCE).any(-1)
        germinable = (
            masks.slot[:, LifecycleOp.GERMINATE]
            & masks.blueprint.any(-1)
            & ops[:, LifecycleOp.GERMINATE, None]
            & when[:, None]
        )

        rules: list[tuple[LifecycleOp, Tensor]] = [
            (LifecycleOp.PRUNE, prunable),
            (LifecycleOp.ADVANCE, advanceable),
            (LifecycleOp.GERMINATE, germinable),
        ]
        if config.germinate_at:  # a scheduled planting outranks a fossilize (module docs)
            rules[1], rules[2] = rules[2], rules[1]
        if config.retry_refused_advance:
            rules.append((LifecycleOp.ADVANCE, can_advance))

        # Fold from the lowest priority up, so a higher rule that fires overrides.
        n_envs = obs.shape[0]
        op = torch.full((n_envs,), int(LifecycleOp.WAIT), dtype=torch.long, device=obs.device)
        slot = torch.zeros_like(op)
        for rule_op, candidates in reversed(rules):
            fires = candidates.any(-1)
            op = torch.where(fires, int(rule_op), op)
            slot = torch.where(fires, _first_true(candidates, self._slot_scores), slot)

        blueprint = _first_true(select_row(masks.blueprint, slot), self._blueprint_scores)
        blend = _first_true(masks.blend, self._blend_scores)
        return self.chose(torch.stack((op, slot, blueprint, blend), dim=-1), hidden)

    # ---------------------------------------------------------------- internals
    def _check(self, obs: Tensor, masks: ActionMasks) -> None:
        """Shape and device checks only (metadata, no host read)."""
        if obs.device != self._slot_scores.device:
            raise ValueError(
                f"HeuristicController.act: obs is on {obs.device} but the controller on "
                f"{self._slot_scores.device}; move it with .to(device), as the policy"
            )
        if obs.ndim != 2 or obs.shape[-1] != self.layout.dim:
            raise ValueError(
                f"HeuristicController.act: obs must be [E, {self.layout.dim}], "
                f"got {tuple(obs.shape)}"
            )
        n_ops, n_slots, n_blueprints, n_blends = (h.size for h in self.schema.heads)
        n_envs = obs.shape[0]
        expected = {
            "op": (n_envs, n_ops),
            "slot": (n_envs, n_ops, n_slots),
            "blueprint": (n_envs, n_slots, n_blueprints),
            "blend": (n_envs, n_blends),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(masks, name).shape)
            if actual != shape:
                raise ValueError(
                    f"HeuristicController.act: masks.{name} must be {shape} for this schema "
                    f"and {n_envs} envs, got {actual}"
                )
