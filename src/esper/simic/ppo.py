"""The PPO update for the recurrent, masked policy: clipped surrogate, clipped value, entropy.

Modelled on CleanRL's ``ppo.py``: :func:`ppo_update` reads top to bottom as the
algorithm. What is specific to Esper:

* **Recurrent minibatches.** A minibatch is a subset of *envs*, each with its whole
  ``T``-step sequence, its stored LSTM states and their restart flags
  (:class:`~esper.simic.ppo_batch.PPOBatch`), so the LSTM is unrolled over exactly the
  data and from exactly the states the rollout acted from, across governor restores too.
* **Invalid steps.** A governor rollback drops some transitions of one env. They stay
  in the tensors (shapes are fixed) with ``valid = False`` and are excluded by masked
  means, never by boolean indexing (a host read). Their stored log-probs, values,
  advantages and returns may hold anything, NaN included: they are replaced by zeros
  before use, so they change neither the loss nor its gradient. Their *observations*
  still run through the LSTM, as they did in the rollout, so they must be finite.
* **Host reads.** With ``target_kl=None`` the update reads nothing on the host: every
  statistic is returned as a device scalar for the caller's one packed transfer. With
  ``target_kl`` set, the update reads the epoch's mean approx-KL once at the end of
  each epoch to decide whether to stop early: at most ``update_epochs`` reads per
  update, against the rollout loop's rule of none per step.
* The minibatch permutation is drawn on the CPU (index bookkeeping; ``generator`` makes
  it reproducible) and copied to the device without blocking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from esper.contracts.config_errors import (
    ConfigError,
    owned_by,
    require_bool,
    require_int,
    require_number,
)
from esper.mdp.pairing import Pairing, check_pairing
from esper.simic.advantages import leave_one_out
from esper.simic.ppo_batch import PPOBatch
from esper.tamiyo.policy import PolicyNetwork

#: The statistics :func:`ppo_update` returns, each a mean over the minibatches it ran.
STAT_NAMES: tuple[str, ...] = (
    "policy_loss",
    "value_loss",
    "entropy",
    "approx_kl",
    "clip_fraction",
    "grad_norm",
)


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters, CleanRL's defaults but for learning rate, epochs and advantages.

    Defaults follow CleanRL's ``ppo.py`` except ``lr`` and ``update_epochs``, which are set
    for Esper's small batches, and the advantages: with paired envs each env's return
    less its group's others' (``critic_baseline`` false, so ``vf_coef`` 0 trains no critic).

    A rollout of the default run is 4 envs x 24 decisions: CleanRL's 4 epochs at 3e-4 make
    8 small Adam steps on it, and the policy barely moved (``ppo/approx_kl`` about 1e-5,
    ``ppo/clip_fraction`` 0 in every update of the default 6-update run). With 10 epochs at
    1e-3 the same run measured approx_kl 0.009 to 0.027 and clip_fraction 0.16 to 0.28 per
    update (10 epochs at 3e-4: approx_kl 4e-4 to 2e-3), and with ``anneal_lr`` 0.006 to
    0.009 in all but the last (benchmarks/README.md).

    ``n_minibatches`` splits the *envs* (whole sequences), so it may not exceed the
    number of envs. ``value_clip_coef=None`` disables value clipping; ``target_kl=None``
    disables early stopping (and with it the update's only host reads). ``gamma`` and
    ``gae_lambda`` are read by GAE, kept here so one config describes the algorithm.

    Attributes:
        lr: Adam learning rate of the policy; lower it if ppo/approx_kl runs high, raise it
            if the policy barely moves (the start of the schedule when anneal_lr is on).
        clip_coef: PPO clip range: the probability ratio is clipped to 1 +/- clip_coef;
            smaller makes each update more conservative (ppo/clip_fraction counts clips).
        value_clip_coef: how far a value prediction may move from the rollout's value
            before its loss is clipped; null disables value clipping.
        vf_coef: weight of the value loss against the policy loss in the one shared loss;
            0 by default, where no critic enters the advantages (critic_baseline false);
            give it a weight (0.5 is CleanRL's) with critic_baseline true.
        ent_coef: weight of the entropy bonus; raise it to keep the policy exploring
            (model.ent_coef_final anneals it over the run).
        update_epochs: passes over each rollout per PPO update; more passes move the
            policy further per rollout (watch ppo/approx_kl).
        n_minibatches: minibatches per pass, each a set of whole env sequences; at most
            the envs per rank, and update_epochs * n_minibatches optimiser steps per update.
        max_grad_norm: the policy's gradient norm is clipped to this before each step.
        target_kl: stop an update's passes early once a pass's mean approx KL exceeds
            this; null never stops early and makes no host read.
        normalize_advantages: standardise the advantages of each minibatch (mean 0,
            std 1) before the clipped surrogate loss.
        gamma: discount of future rewards in GAE; lower values weigh near rewards more.
            1 (the default) keeps the reward's telescoping: the return from a step is the
            final accuracy minus the accuracy then (plus rent), which is what growth is
            judged by; below 1 the policy optimises a discounted sum that is not.
        gae_lambda: GAE trace decay in [0, 1]: 0 gives one-step TD errors (less variance,
            more bias), 1 Monte Carlo returns (the default: with paired envs the
            leave-one-out baseline takes the variance out that the critic would).
        anneal_lr: let lr fall linearly to 0 by the run's last update
            (trainer.max_epochs); false keeps lr fixed.
        paired_envs: start every env of a rollout from the same host and data, and take
            each env's advantage relative to the others' (needs 2+ envs per rank).
        critic_baseline: with paired_envs, take the leave-one-out baseline of the GAE
            advantages (returns minus the critic's values); false (the default) takes it
            of the returns alone (RLOO), and the critic only reports
            ppo/explained_variance. False needs paired_envs, or no baseline is left.
        pair_size: envs per paired group: a rank's envs split into groups of this many,
            each group starting from its own host, and each host trains on 1/pair_size of
            every batch; a rank with no more envs than this is one group; null: one group.
        adam_eps: epsilon of the policy's Adam optimiser (CleanRL uses 1e-5).
        advantage_norm_eps: added to the advantages' std when normalising them, so
            equal advantages do not divide by zero.
    """

    lr: float = 1e-3
    clip_coef: float = 0.2
    value_clip_coef: float | None = 0.2
    #: The value loss's weight: 0 because the default advantages use no critic.
    vf_coef: float = 0.0
    ent_coef: float = 0.01
    update_epochs: int = 10
    n_minibatches: int = 2
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    normalize_advantages: bool = True
    gamma: float = 1.0
    gae_lambda: float = 1.0
    #: Let the learning rate fall linearly to 0 by the run's last update (CleanRL's
    #: ``anneal_lr``): at a fixed 1e-3 a 60-update run's approx_kl climbed past 0.05 as the
    #: policy sharpened (benchmarks/README.md).
    anneal_lr: bool = True
    #: Start every env of a rollout from the same host weights and take each env's
    #: advantage relative to the other envs' at the same step (``simic/advantages.py``):
    #: what the host's own luck adds to a return cancels, what the actions did stays.
    #: Needs at least 2 envs per rank. On: measured in benchmarks/README.md.
    paired_envs: bool = True
    #: Envs per paired group: 4, the default run's envs, so that raising ``n_envs`` adds
    #: groups (more transitions per update) and leaves each host on a quarter of every
    #: batch, the task the defaults were measured on; one group of 8 would halve each
    #: host's data. 8 envs in two groups, measured in benchmarks/README.md, did not learn
    #: a better policy in 60 updates than the default 4.
    pair_size: int | None = 4
    #: Subtract the critic's values before the leave-one-out baseline. Off (RLOO, with
    #: ``vf_coef`` 0): the paired envs' returns are a baseline the policy's own noise does
    #: not enter, while the critic's values were fitted to returns whose differences are
    #: fractions of a point; off learned as well with half the spread over training seeds
    #: (benchmarks/README.md, "Design figures kept out of docstrings").
    critic_baseline: bool = False
    adam_eps: float = 1e-5
    advantage_norm_eps: float = 1e-8

    def __post_init__(self) -> None:
        with owned_by(self):
            for name in ("lr", "clip_coef", "max_grad_norm", "adam_eps", "advantage_norm_eps"):
                require_number(name, getattr(self, name), above=0.0)
            for name in ("value_clip_coef", "target_kl"):
                require_number(name, getattr(self, name), above=0.0, null="disable it")
            for name in ("vf_coef", "ent_coef"):
                require_number(name, getattr(self, name), at_least=0.0)
            for name in ("update_epochs", "n_minibatches"):
                require_int(name, getattr(self, name), 1)
            check_pairing(self.paired_envs, self.pair_size)
            for name in ("gamma", "gae_lambda"):
                require_number(name, getattr(self, name), at_least=0.0, at_most=1.0)
            for name in ("normalize_advantages", "anneal_lr", "critic_baseline"):
                require_bool(name, getattr(self, name))
            if not self.critic_baseline and not self.paired_envs:
                raise ConfigError(
                    "critic_baseline",
                    "false needs paired_envs: true (the other envs' returns are the "
                    "baseline); unpaired, set critic_baseline: true and vf_coef: 0.5 so "
                    "a trained critic's values are",
                )
            if self.critic_baseline and self.vf_coef == 0:
                raise ConfigError(
                    "vf_coef",
                    "0 with critic_baseline: true leaves the critic untrained and its values "
                    "no baseline; give it a weight (0.5 is CleanRL's)",
                )

    @property
    def pairing(self) -> Pairing:
        """``paired_envs`` and ``pair_size`` as the env runs them (``esper.mdp.pairing``)."""
        return Pairing(self.paired_envs, self.pair_size)


class PPOLosses(NamedTuple):
    """Scalar device tensors for one minibatch; the first three carry gradients."""

    policy: Tensor
    value: Tensor
    entropy: Tensor
    approx_kl: Tensor
    clip_fraction: Tensor


def masked_mean(x: Tensor, valid: Tensor, n_valid: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over ``valid`` entries (same shape); 0 if none is valid; non-finite
    values at invalid entries neither leak into the result nor into its gradient.
    ``n_valid`` is :func:`valid_count` of ``valid``, for callers that take several means
    over one mask (three kernels each saved)."""
    n_valid = valid_count(valid, x.dtype) if n_valid is None else n_valid.to(x.dtype)
    return torch.where(valid, x, 0.0).sum() / n_valid


def valid_count(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """How many entries of ``valid`` are True, at least 1, as a ``dtype`` device scalar:
    what :func:`masked_mean` divides by."""
    return valid.sum().clamp_min(1).to(dtype)


def explained_variance(values: Tensor, returns: Tensor, valid: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the ``valid`` entries, a device scalar.

    How much of the variation in the returns the critic's values predicted: 1 is
    perfect, 0 no better than a constant, below 0 worse than one. Shapes: all ``[E, T]``.
    A batch whose returns do not vary gives 0 (nothing to explain), never NaN.
    """
    mean_r = masked_mean(returns, valid)
    var_r = masked_mean((returns - mean_r) ** 2, valid)
    residual = returns - values
    var_res = masked_mean((residual - masked_mean(residual, valid)) ** 2, valid)
    tiny = torch.finfo(var_r.dtype).tiny
    return torch.where(var_r > tiny, 1.0 - var_res / var_r.clamp_min(tiny), torch.zeros_like(var_r))


def ppo_losses(
    batch: PPOBatch,
    new_log_prob: Tensor,
    entropy: Tensor,
    new_value: Tensor,
    config: PPOConfig,
) -> PPOLosses:
    """Clipped-surrogate, value and entropy terms for ``batch`` given the policy's
    re-evaluation of it (``[E, T]`` each), averaged over valid steps."""
    valid = batch.valid
    n_valid = valid_count(valid, new_log_prob.dtype)
    # Invalid steps may hold garbage (NaN after a failed epoch): zero it before any
    # arithmetic, or 0 * NaN would reach the gradient.
    old_log_prob = torch.where(valid, batch.log_probs, 0.0)
    old_value = torch.where(valid, batch.values, 0.0)
    returns = torch.where(valid, batch.returns, 0.0)
    advantages = torch.where(valid, batch.advantages, 0.0)
    if config.normalize_advantages:
        mean = masked_mean(advantages, valid, n_valid)
        std = masked_mean((advantages - mean).square(), valid, n_valid).sqrt()
        advantages = (advantages - mean) / (std + config.advantage_norm_eps)

    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - log_ratio, valid, n_valid)
        clip_fraction = masked_mean(
            ((ratio - 1.0).abs() > config.clip_coef).to(ratio.dtype), valid, n_valid
        )

    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
    policy_loss = masked_mean(torch.maximum(pg_loss1, pg_loss2), valid, n_valid)

    value_loss_unclipped = (new_value - returns).square()
    if config.value_clip_coef is not None:
        value_clipped = old_value + (new_value - old_value).clamp(
            -config.value_clip_coef, config.value_clip_coef
        )
        value_loss_per_step = torch.maximum(
            value_loss_unclipped, (value_clipped - returns).square()
        )
    else:
        value_loss_per_step = value_loss_unclipped
    value_loss = 0.5 * masked_mean(value_loss_per_step, valid, n_valid)

    return PPOLosses(
        policy=policy_loss,
        value=value_loss,
        entropy=masked_mean(entropy, valid, n_valid),
        approx_kl=approx_kl,
        clip_fraction=clip_fraction,
    )


def minibatch_losses(policy: PolicyNetwork, mb: PPOBatch, config: PPOConfig) -> PPOLosses:
    """The policy's replay of minibatch ``mb`` (:meth:`PolicyNetwork.evaluate`) and its
    PPO terms (:func:`ppo_losses`)."""
    new_log_prob, entropy, new_value = policy.evaluate(
        mb.obs,
        mb.hidden0,
        mb.masks,
        mb.actions,
        mb.episode_starts,
        hidden_restarts=mb.hidden_restarts,
        stored_hidden=mb.hidden,
        breaks=mb.breaks,
    )
    return ppo_losses(mb, new_log_prob, entropy, new_value, config)


def total_loss(losses: PPOLosses, ent_coef: float | Tensor, config: PPOConfig) -> Tensor:
    """The one loss a minibatch step back-propagates: the clipped surrogate less the
    entropy bonus plus the weighted value loss. ``ent_coef`` a float or a device scalar
    (a recorded step reads it from a tensor: it anneals between updates)."""
    return losses.policy - ent_coef * losses.entropy + config.vf_coef * losses.value


#: What runs an epoch's minibatch forwards for :func:`ppo_update`: ``(batch, order,
#: ent_coef)``, ``order`` the epoch's shuffle of the envs (long, on the CPU), to each
#: minibatch's PPO terms and the loss to back-propagate, lazily, in order: the envs
#: ``order`` lists, cut into ``n_minibatches`` as :meth:`PPOBatch.split_envs` cuts them
#: (``esper.simic.ppo_graph`` records and replays each).
MinibatchPasses = Callable[[PPOBatch, Tensor, float], Iterable[tuple[PPOLosses, Tensor]]]


def _eager_pass(
    policy: PolicyNetwork, mb: PPOBatch, ent_coef: float, config: PPOConfig
) -> tuple[PPOLosses, Tensor]:
    losses = minibatch_losses(policy, mb, config)
    return losses, total_loss(losses, ent_coef, config)


def make_optimizer(policy: nn.Module, config: PPOConfig) -> torch.optim.Adam:
    """Adam with CleanRL's ``eps=1e-5`` (via ``config.adam_eps``), fused.

    Fused: one kernel steps every parameter, and the step counters live beside them, so a
    step reads nothing on the host. The per-parameter loop (the CPU's default) issued about
    ten operators per parameter and read each step counter with ``.item()``; a PPO update
    makes ``update_epochs * n_minibatches`` steps, and on a GPU every operator is a launch.
    Measured on the 2-core CPU (18 parameters, 160 673 values): 613 us a step per parameter,
    486 with ``foreach`` (the GPU's default), 167 fused.
    """
    return torch.optim.Adam(policy.parameters(), lr=config.lr, eps=config.adam_eps, fused=True)


def trained_advantages(batch: PPOBatch, config: PPOConfig) -> Tensor:
    """``[E, T]`` advantages the update trains on: the batch's GAE advantages, or with
    ``paired_envs`` those (``critic_baseline``) or the returns less the mean of the other
    envs' of the same paired group at the same step (:func:`leave_one_out`)."""
    if not config.paired_envs:
        return batch.advantages
    group = config.pairing.group(batch.n_envs)
    source = batch.advantages if config.critic_baseline else batch.returns
    return leave_one_out(source, batch.valid, group)


def ppo_update(
    policy: PolicyNetwork,
    optimizer: torch.optim.Optimizer,
    batch: PPOBatch,
    config: PPOConfig,
    ent_coef: float | None = None,
    generator: torch.Generator | None = None,
    backward: Callable[[Tensor], None] | None = None,
    minibatch_passes: MinibatchPasses | None = None,
) -> dict[str, Tensor]:
    """Run ``config.update_epochs`` epochs of recurrent-minibatch PPO on ``batch``.

    ``ent_coef`` overrides ``config.ent_coef`` (for annealing). ``backward`` replaces
    ``loss.backward()``: a LightningModule passes ``manual_backward`` so that under DDP
    every optimiser step sees gradients averaged over ranks. ``minibatch_passes`` replaces
    the policy's forwards over an epoch's minibatches and their losses
    (:data:`MinibatchPasses`: recorded ones, ``esper.simic.ppo_graph``). Returns device scalars:
    the :data:`STAT_NAMES` averaged over the minibatches run, ``epochs_run`` (fewer
    than ``update_epochs`` only after a target-KL stop) and ``explained_variance`` of the
    rollout's values against its returns. Host reads: none when
    ``config.target_kl`` is None, else one per epoch run.
    """
    ent_coef = config.ent_coef if ent_coef is None else ent_coef
    if not ent_coef >= 0:
        raise ValueError(
            f"ppo_update: ent_coef must be >= 0 (annealed towards 0), got {ent_coef!r}"
        )
    if batch.n_envs < config.n_minibatches:
        raise ValueError(
            f"PPOConfig.n_minibatches={config.n_minibatches} exceeds the batch's {batch.n_envs} "
            "envs; minibatches are whole env sequences, so lower n_minibatches"
        )
    batch = replace(batch, advantages=trained_advantages(batch, config))
    device = batch.obs.device
    totals = torch.zeros(len(STAT_NAMES), device=device)
    epochs_run = 0

    for _ in range(config.update_epochs):
        epoch_kl = torch.zeros((), device=device)
        env_order = torch.randperm(batch.n_envs, generator=generator)
        if minibatch_passes is None:
            # Shuffled once an epoch, then cut: one gather a field, not one a minibatch.
            passes: Iterable[tuple[PPOLosses, Tensor]] = (
                _eager_pass(policy, mb, ent_coef, config)
                for mb in batch.select_envs(env_order).split_envs(config.n_minibatches)
            )
        else:
            passes = minibatch_passes(batch, env_order, ent_coef)
        # Lazily: each minibatch's forward runs after the step before it.
        for losses, loss in passes:
            optimizer.zero_grad(set_to_none=True)
            if backward is None:
                loss.backward()
            else:
                backward(loss)
            grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
            optimizer.step()
            # Under autocast (a bf16-mixed fit's training step) the next forward would
            # reuse the casts of the weights this step just moved: autocast keeps them for
            # its whole region, and Lightning's spans the update.
            torch.clear_autocast_cache()

            stats = {
                "policy_loss": losses.policy,
                "value_loss": losses.value,
                "entropy": losses.entropy,
                "approx_kl": losses.approx_kl,
                "clip_fraction": losses.clip_fraction,
                "grad_norm": grad_norm,
            }
            totals += torch.stack([stats[name].detach().to(totals.dtype) for name in STAT_NAMES])
            epoch_kl += losses.approx_kl
        epochs_run += 1

        # The update's only host read, made only when early stopping is asked for.
        if config.target_kl is not None and epoch_kl / config.n_minibatches > config.target_kl:
            break

    means = totals / (epochs_run * config.n_minibatches)
    result = dict(zip(STAT_NAMES, means.unbind(), strict=True))
    result["epochs_run"] = torch.full((), float(epochs_run), device=device)
    result["explained_variance"] = explained_variance(batch.values, batch.returns, batch.valid)
    return result
