"""The ``periodic`` control: plant at evenly spaced epochs, keep what the gates allow.

A fixed schedule sits between no growth and a learned policy: it grows as much as the
slots allow, at times chosen without looking at the host. If a learned policy cannot
beat it, what the policy learned is *that* growth pays, not *when* or *where*.

It is a :class:`~esper.tamiyo.heuristic.HeuristicController` with a config: germination
only at the scheduled epochs (``HeuristicConfig.germinate_at``), in the first free slot,
with the scripted grower's blueprint preference and blend mode; fossilize as soon as
the gate allows, retrying a refused advance; never prune. So it decides on the device
with no host reads, like every controller, and reads the raw observation.
"""

from __future__ import annotations

import dataclasses

from esper.contracts import ActionSchema, ObservationLayout
from esper.contracts.config_errors import require_int
from esper.kasmina.lifecycle import LifecycleConfig
from esper.tamiyo.heuristic import (
    SCRIPTED_GROWTH,
    HeuristicConfig,
    HeuristicController,
    preferring_what_fits,
)

#: The first decision follows this host epoch: the env trains one epoch at reset, then
#: asks the controller (``esper.mdp.env.MorphogeneticVecEnv.reset``).
FIRST_DECISION_EPOCH = 1
#: The epoch a seed spends GERMINATED: planted at one decision, the clock moves it on at
#: the next (``esper.mdp.lifecycle_ops.OpApplier``).
GERMINATED_EPOCHS = 1
#: The clock moves a seed one stage per decision, so a stage whose minimum is 0 epochs
#: still lasts one.
MIN_EPOCHS_PER_STAGE = 1
#: Accuracy changes lie in [-1, 1]: a plateau threshold above 1 reads every epoch as a
#: plateau, so the schedule alone decides when to plant.
ALWAYS_PLATEAU = 2.0
#: Germination is allowed up to the episode's end; the schedule keeps it where a seed
#: can still fossilize.
WHOLE_EPISODE = 1.0


def epochs_to_fossilize(lifecycle: LifecycleConfig) -> int:
    """Host epochs from the decision that plants a seed to the first that can fossilize it.

    Planted at the decision after host epoch ``h``, a seed trains epoch ``h + 1`` in
    GERMINATED; the env's clock then carries it through TRAINING
    (``min_training_epochs``), BLENDING (``blend_epochs``) and HOLDING
    (``min_holding_epochs``), each at least one epoch since the clock moves a seed one
    stage per decision; the decision after the last of them may ADVANCE it to
    FOSSILIZED. With the default lifecycle (1/1/1): 1 + 1 + 1 + 1 = 4.
    """
    return (
        GERMINATED_EPOCHS
        + max(MIN_EPOCHS_PER_STAGE, lifecycle.min_training_epochs)
        + max(MIN_EPOCHS_PER_STAGE, lifecycle.blend_epochs)
        + max(MIN_EPOCHS_PER_STAGE, lifecycle.min_holding_epochs)
    )


def periodic_schedule(
    episode_epochs: int, n_slots: int, lifecycle: LifecycleConfig
) -> tuple[int, ...]:
    """The host epochs after which to plant, one per slot, evenly spaced.

    Decisions follow host epochs ``1 .. episode_epochs - 1`` (none follows the last
    epoch). A seed planted after epoch ``h`` can first be fossilized after epoch
    ``h + epochs_to_fossilize(lifecycle)``, so the plantings that can still pay are those
    after epochs ``1 .. latest`` with ``latest = episode_epochs - 1 - epochs_to_fossilize``.
    That window is cut into ``n_slots`` equal shares and each seed is planted at the
    first whole epoch of its share (its start rounded up): the plantings are as evenly
    spread as whole epochs allow, the first at the first decision, and the later ones
    leave their seeds the rest of their share to retry a refused fossilize.

    With the defaults (25 epochs, 3 slots, lifecycle 1/1/1): a seed needs 4 epochs, the
    window is epochs 1..20 (20 epochs), each share 20/3 = 6.67 epochs, starting at 1,
    7.67 and 14.33: plant after epochs (1, 8, 15), fossilizable after 5, 12 and 19, the
    last with five decisions (20 to 24) to spare. (A 2/3/1 lifecycle gives (1, 7, 13).)

    A shorter episode gets fewer plantings: one per epoch of the window, and where no
    seed could fossilize at all, one at the first decision, which blends in as far as
    the episode allows. So the control runs on any episode a policy can be trained on
    (``esper evaluate`` runs it by default), planting what a schedule can.

    Raises:
        ValueError: the episode holds no decision (``episode_epochs < 2``), or no slot.
    """
    episode_epochs = require_int(
        "episode_epochs",
        episode_epochs,
        FIRST_DECISION_EPOCH + 1,
        hint="an episode with a decision",
    )
    n_slots = require_int("n_slots", n_slots, 1)
    latest = max(FIRST_DECISION_EPOCH, episode_epochs - 1 - epochs_to_fossilize(lifecycle))
    window = latest - FIRST_DECISION_EPOCH + 1
    plantings = min(n_slots, window)
    # First whole epoch of share i: FIRST + ceil(i * window / plantings), in integers.
    return tuple(
        FIRST_DECISION_EPOCH + (i * window + plantings - 1) // plantings for i in range(plantings)
    )


def periodic_config(
    schema: ActionSchema, episode_epochs: int, lifecycle: LifecycleConfig
) -> HeuristicConfig:
    """The :class:`HeuristicConfig` of the periodic controller for this host and episode.

    The scripted grower's (:data:`~esper.tamiyo.heuristic.SCRIPTED_GROWTH`) blueprint
    preference, cut to what ``schema`` offers, and blend mode; its prune threshold (a
    contribution never falls below -1, so it never prunes); refused advances retried;
    germination at the scheduled epoch fractions only.
    """
    schedule = periodic_schedule(episode_epochs, len(schema.slot_ids), lifecycle)
    return dataclasses.replace(
        preferring_what_fits(SCRIPTED_GROWTH, schema),
        plateau_delta=ALWAYS_PLATEAU,
        max_germinate_fraction=WHOLE_EPISODE,
        retry_refused_advance=True,
        germinate_at=tuple(epoch / episode_epochs for epoch in schedule),
    )


def periodic_controller(
    layout: ObservationLayout,
    schema: ActionSchema,
    episode_epochs: int,
    lifecycle: LifecycleConfig,
) -> HeuristicController:
    """The ``periodic`` control for a host of ``schema``'s slots (see module docs).

    It plants after the epochs of :func:`periodic_schedule` in the first free slot (slot
    order), skipping a scheduled epoch where no slot is free, fossilizes whenever the
    gate allows, and never prunes. It reads raw observations, as every heuristic does.
    """
    return HeuristicController(layout, schema, periodic_config(schema, episode_epochs, lifecycle))


__all__ = ["periodic_controller", "periodic_schedule"]
