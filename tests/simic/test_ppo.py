"""ppo_update: config checks, no host reads, invalid steps ignored, and it learns a bandit."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from esper.host_reads import HostReadCounter
from esper.mdp.rewards import RewardConfig, RewardInputs, shaped_reward, total
from esper.simic.gae import compute_gae
from esper.simic.ppo import (
    STAT_NAMES,
    PPOBatch,
    PPOConfig,
    make_optimizer,
    masked_mean,
    ppo_losses,
    ppo_update,
    trained_advantages,
    valid_count,
)
from esper.tamiyo.action_masks import ActionMasks
from esper.tamiyo.policy import LSTMState, PolicyConfig, PolicyNetwork
from tests.ops import OpCounter
from tests.simic import bandit_env
from tests.simic.bandit_env import BEST_ACTION, BanditEnv
from tests.tamiyo.factories import OBS_DIM, make_policy, random_masks


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """These tiny ops gain nothing from intra-op threads, and on a busy 2-core runner two
    threads spin against other processes (seen: 14 s instead of 2 s for the learning test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stored_states(acted_from: list[LSTMState]) -> LSTMState:
    """Per-step ``[layers, E, H]`` states stacked as a buffer stores them, ``[E, T, layers, H]``."""
    h, c = (torch.stack([state[i] for state in acted_from], 1) for i in (0, 1))
    return h.permute(2, 1, 0, 3), c.permute(2, 1, 0, 3)


def _rollout_batch(
    policy: PolicyNetwork,
    n_envs: int = 8,
    n_steps: int = 5,
    seed: int = 0,
    unbroken: bool = False,
    breaks_known: bool = False,
) -> PPOBatch:
    """A batch from real act() calls with random masks, starts, rewards, a few invalid steps
    and a few hidden restarts (steps acting from a stored state, as after a restore); with
    ``unbroken``, one episode an env from step 0 and no restart, and the batch says so;
    with ``breaks_known`` it lists where each env's chain of states breaks, as a buffer
    does (``PPOBatch.breaks``)."""
    g = torch.Generator().manual_seed(seed)
    hidden = policy.initial_state(n_envs)
    obs, starts, step_masks, actions, log_probs, values = [], [], [], [], [], []
    restarts, acted_from = [], []
    for t in range(n_steps):
        o = torch.randn(n_envs, OBS_DIM, generator=g)
        s = torch.full((n_envs,), t == 0) | (torch.rand(n_envs, generator=g) < 0.2)
        r = (torch.rand(n_envs, generator=g) < 0.3) & (t > 0)
        if unbroken:
            s, r = torch.full((n_envs,), t == 0), torch.zeros_like(r)
        elsewhere = tuple(torch.randn(h.shape, generator=g) for h in hidden)
        hidden = tuple(
            torch.where(r.view(1, -1, 1), x, h) for x, h in zip(elsewhere, hidden, strict=True)
        )
        m = random_masks((n_envs,), g)
        result = policy.act(o, hidden, m, episode_starts=s, generator=g)
        acted_from.append(hidden)
        hidden = result.hidden
        obs.append(o)
        starts.append(s)
        restarts.append(r)
        step_masks.append(m)
        actions.append(result.actions)
        log_probs.append(result.log_prob)
        values.append(result.value)
    broken = (torch.stack(starts, 1) | torch.stack(restarts, 1))[:, 1:]
    breaks = tuple(tuple(int(t) + 1 for t in row.nonzero().flatten()) for row in broken)
    valid = torch.ones(n_envs, n_steps, dtype=torch.bool)
    valid[0, 1:3] = False  # dropped mid-sequence (a rollback)
    valid[1, -2:] = False  # dropped at the tail
    return PPOBatch(
        obs=torch.stack(obs, 1),
        actions=torch.stack(actions, 1),
        log_probs=torch.stack(log_probs, 1),
        values=torch.stack(values, 1),
        advantages=torch.randn(n_envs, n_steps, generator=g),
        returns=torch.randn(n_envs, n_steps, generator=g),
        masks=ActionMasks.stack(step_masks),
        hidden=_stored_states(acted_from),
        episode_starts=torch.stack(starts, 1),
        hidden_restarts=torch.stack(restarts, 1),
        valid=valid,
        breaks=breaks if unbroken or breaks_known else None,
    )


# ------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", 0.0),
        ("clip_coef", -0.1),
        ("value_clip_coef", 0.0),
        ("vf_coef", -1.0),
        ("ent_coef", -0.01),
        ("update_epochs", 0),
        ("n_minibatches", 1.5),
        ("max_grad_norm", 0.0),
        ("target_kl", 0.0),
        ("gamma", 1.5),
        ("gae_lambda", -0.1),
        ("adam_eps", 0.0),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"PPOConfig.{field}"):
        PPOConfig(**{field: value})  # type: ignore[arg-type]


def test_config_accepts_disabled_options() -> None:
    config = PPOConfig(value_clip_coef=None, target_kl=None)
    assert config.value_clip_coef is None and config.target_kl is None


def test_more_minibatches_than_envs_is_refused() -> None:
    policy = make_policy()
    batch = _rollout_batch(policy, n_envs=2)
    with pytest.raises(ValueError, match="n_minibatches"):
        ppo_update(policy, make_optimizer(policy, PPOConfig()), batch, PPOConfig(n_minibatches=3))


def test_batch_rejects_mismatched_shapes() -> None:
    batch = _rollout_batch(make_policy())
    with pytest.raises(ValueError, match=r"PPOBatch\.returns"):
        dataclasses.replace(batch, returns=batch.returns[:, :-1])


# ---------------------------------------------------------------- the update
def test_update_returns_finite_device_scalars() -> None:
    policy = make_policy()
    batch = _rollout_batch(policy)
    config = PPOConfig()
    stats = ppo_update(policy, make_optimizer(policy, config), batch, config)
    assert set(stats) == {*STAT_NAMES, "epochs_run", "explained_variance"}
    for name, value in stats.items():
        assert value.dim() == 0, name
        assert torch.isfinite(value), name
    assert stats["epochs_run"] == config.update_epochs


def test_first_minibatch_starts_on_policy() -> None:
    """Right after the rollout the ratio is 1: evaluate replays act, so KL and clipping are 0."""
    policy = make_policy()
    batch = _rollout_batch(policy)
    assert batch.hidden_restarts.any(), "the test needs hidden restarts"
    log_prob, entropy, value = policy.evaluate(
        batch.obs,
        batch.hidden0,
        batch.masks,
        batch.actions,
        batch.episode_starts,
        hidden_restarts=batch.hidden_restarts,
        stored_hidden=batch.hidden,
    )
    losses = ppo_losses(batch, log_prob, entropy, value, PPOConfig())
    assert losses.approx_kl.abs() < 1e-6
    assert losses.clip_fraction == 0
    assert losses.policy.abs() < 1e-5  # normalised advantages have mean 0


def test_the_update_replays_each_minibatch_from_the_stored_states_it_acted_from() -> None:
    """One minibatch, one epoch: its statistics come from the policy that acted, so a
    replay that ignored the hidden restarts (or lost them in select_envs) would show a KL."""

    def sharp_policy() -> PolicyNetwork:
        # Far from uniform, so the action probabilities depend on the LSTM state.
        policy = make_policy()
        with torch.no_grad():
            for head in (policy.op_head, policy.slot_head, policy.blueprint_head):
                head.weight.mul_(300.0)
        return policy

    batch = _rollout_batch(sharp_policy())
    assert batch.hidden_restarts.any(), "the test needs hidden restarts"
    config = PPOConfig(n_minibatches=1, update_epochs=1)
    policy = sharp_policy()
    stats = ppo_update(policy, make_optimizer(policy, config), batch, config)
    assert stats["approx_kl"].abs() < 1e-6
    assert stats["clip_fraction"] == 0
    # Without the flags the same data replays other states.
    chained = dataclasses.replace(batch, hidden_restarts=torch.zeros_like(batch.hidden_restarts))
    policy = sharp_policy()
    stats = ppo_update(policy, make_optimizer(policy, config), chained, config)
    assert stats["approx_kl"] > 1e-3


def test_an_unbroken_batch_updates_the_policy_as_the_step_by_step_replay_does() -> None:
    """``PPOBatch.unbroken`` lets the replay run the LSTM in one call; the update it
    makes is the step loop's, within float rounding."""
    batch = _rollout_batch(make_policy(), n_steps=12, unbroken=True)
    config = PPOConfig(update_epochs=2)
    policies, ops = [], []
    for flag in (False, True):
        policy = make_policy()
        with OpCounter() as counter:
            stats = ppo_update(
                policy,
                make_optimizer(policy, config),
                batch if flag else dataclasses.replace(batch, breaks=None),
                config,
                generator=torch.Generator().manual_seed(0),
            )
        assert stats["approx_kl"].abs() < 1e-3
        policies.append(policy)
        ops.append(counter.total)
    assert ops[1] < ops[0] / 2, ops  # the replay's LSTM ran in one call a minibatch
    stepped, fused = (dict(p.named_parameters()) for p in policies)
    moved = [
        name for name, p in stepped.items() if not torch.equal(p, make_policy().state_dict()[name])
    ]
    assert any(name.startswith("lstm") for name in moved)  # the update trained the LSTM
    for name, param in stepped.items():
        torch.testing.assert_close(fused[name], param, atol=1e-5, rtol=1e-5, msg=name)


def test_a_batch_that_lists_its_breaks_updates_the_policy_as_the_step_by_step_replay_does() -> None:
    """Restores and resets after step 0 cut the chains of states; knowing where
    (``PPOBatch.breaks``), the replay runs the stretches between them in one LSTM call a
    minibatch, each from its stored state, and the update is the step loop's within float
    rounding."""
    batch = _rollout_batch(make_policy(), n_steps=12, breaks_known=True)
    assert batch.breaks is not None and sum(map(len, batch.breaks)) >= 8
    config = PPOConfig(update_epochs=2)
    policies, ops = [], []
    for breaks in (None, batch.breaks):
        policy = make_policy()
        with OpCounter() as counter:
            ppo_update(
                policy,
                make_optimizer(policy, config),
                dataclasses.replace(batch, breaks=breaks),
                config,
                generator=torch.Generator().manual_seed(0),
            )
        policies.append(policy)
        ops.append(counter.total)
    assert ops[1] < ops[0] / 2, ops  # the replay's LSTM ran in one call a minibatch
    stepped, segmented = (dict(p.named_parameters()) for p in policies)
    for name, param in stepped.items():
        torch.testing.assert_close(segmented[name], param, atol=1e-5, rtol=1e-5, msg=name)


def test_update_makes_no_host_reads_without_target_kl() -> None:
    policy = make_policy()
    batch = _rollout_batch(policy)
    config = PPOConfig(target_kl=None)
    optimizer = make_optimizer(policy, config)
    generator = torch.Generator().manual_seed(0)
    with HostReadCounter() as counter:
        ppo_update(policy, optimizer, batch, config, generator=generator)
    assert counter.count == 0, counter.report()


def test_target_kl_reads_once_per_epoch_and_stops_early() -> None:
    policy = make_policy()
    batch = _rollout_batch(policy)
    config = PPOConfig(target_kl=1e-12, update_epochs=4, lr=1e-2)
    optimizer = make_optimizer(policy, config)
    with HostReadCounter() as counter:
        stats = ppo_update(policy, optimizer, batch, config)
    assert stats["epochs_run"] == 1
    assert counter.count == 1, counter.report()


def _updated_params(batch: PPOBatch, config: PPOConfig) -> list[torch.Tensor]:
    policy = make_policy(seed=1)
    ppo_update(
        policy,
        make_optimizer(policy, config),
        batch,
        config,
        generator=torch.Generator().manual_seed(5),
    )
    return [p.detach().clone() for p in policy.parameters()]


def _broadcast_to(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[E, T]`` flags viewed to broadcast against an ``[E, T, ...]`` tensor."""
    return flags.view(*flags.shape, *[1] * (like.dim() - flags.dim()))


def test_invalid_steps_do_not_affect_the_update() -> None:
    batch = _rollout_batch(make_policy(seed=1))
    invalid = ~batch.valid
    g = torch.Generator().manual_seed(9)

    def garbage(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.where(invalid, torch.full_like(x, fill), x)

    tail = invalid.clone()
    tail[0] = False  # env 0's invalid steps are mid-sequence: their obs feed later valid steps
    scrambled_actions = torch.randint(0, 3, batch.actions.shape, generator=g)
    changed = dataclasses.replace(
        batch,
        obs=torch.where(tail.unsqueeze(-1), torch.randn(batch.obs.shape, generator=g), batch.obs),
        actions=torch.where(invalid.unsqueeze(-1), scrambled_actions, batch.actions),
        log_probs=garbage(batch.log_probs, float("nan")),
        values=garbage(batch.values, float("inf")),
        advantages=garbage(batch.advantages, 1e6),
        returns=garbage(batch.returns, float("nan")),
        masks=batch.masks.map(lambda m: m & _broadcast_to(batch.valid, m)),  # nothing legal
    )
    config = PPOConfig(n_minibatches=3)
    for before, after in zip(
        _updated_params(batch, config), _updated_params(changed, config), strict=True
    ):
        assert torch.isfinite(after).all()
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    # And the valid data does matter.
    flipped = dataclasses.replace(batch, advantages=-batch.advantages, returns=-batch.returns)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            _updated_params(batch, config), _updated_params(flipped, config), strict=True
        )
    )


# ------------------------------------------------------------ it learns
N_ENVS, N_STEPS = 16, 8
MAX_UPDATES = 60
TARGET_PROB = 0.9
#: CleanRL's defaults but a bandit's gamma of 0 and a higher learning rate: at lr=3e-4 it
#: needs ~39 updates (seeds 0-7), at 1e-3 ~14, so the bound of 60 leaves a wide margin.
LEARNING_CONFIG = PPOConfig(lr=1e-3, gamma=0.0)


def _collect(policy: PolicyNetwork, env: BanditEnv) -> PPOBatch:
    """One episode of ``N_STEPS`` in every env, and GAE (gamma 0: advantage = reward - value)."""
    hidden = policy.initial_state(N_ENVS)
    obs, actions, log_probs, values, rewards, acted_from = [], [], [], [], [], []
    for t in range(N_STEPS):
        o = env.observe()
        starts = torch.full((N_ENVS,), t == 0)
        result = policy.act(o, hidden, env.masks(), episode_starts=starts)
        acted_from.append(hidden)
        hidden = result.hidden
        obs.append(o)
        actions.append(result.actions)
        log_probs.append(result.log_prob)
        values.append(result.value)
        rewards.append(env.step(result.actions))
    values_t = torch.stack(values, 1)
    no_flags = torch.zeros(N_ENVS, N_STEPS, dtype=torch.bool)
    advantages, returns = compute_gae(
        torch.stack(rewards, 1),
        values_t,
        torch.zeros_like(values_t),  # never used at gamma 0
        terminated=no_flags,
        done=no_flags,
        gamma=LEARNING_CONFIG.gamma,
        gae_lambda=LEARNING_CONFIG.gae_lambda,
    )
    starts = no_flags.clone()
    starts[:, 0] = True
    return PPOBatch(
        obs=torch.stack(obs, 1),
        actions=torch.stack(actions, 1),
        log_probs=torch.stack(log_probs, 1),
        values=values_t,
        advantages=advantages,
        returns=returns,
        masks=ActionMasks.stack([env.masks()] * N_STEPS),
        hidden=_stored_states(acted_from),
        episode_starts=starts,
        hidden_restarts=no_flags,
        valid=torch.ones(N_ENVS, N_STEPS, dtype=torch.bool),
    )


def _best_action_prob(policy: PolicyNetwork, batch: PPOBatch) -> float:
    """Lowest probability, over an episode's steps, of the full best action (all 4 heads)."""
    best = torch.tensor(BEST_ACTION).expand(1, N_STEPS, 4)
    first_env = batch.select_envs(torch.tensor([0]))
    with torch.no_grad():
        log_prob, _, _ = policy.evaluate(
            first_env.obs, first_env.hidden0, first_env.masks, best, first_env.episode_starts
        )
    return log_prob.exp().min().item()


def test_ppo_learns_the_best_action_of_a_bandit() -> None:
    torch.manual_seed(0)
    policy = PolicyNetwork(bandit_env.OBS_DIM, bandit_env.SCHEMA, PolicyConfig(hidden_size=32))
    env = BanditEnv(N_ENVS)
    optimizer = make_optimizer(policy, LEARNING_CONFIG)
    generator = torch.Generator().manual_seed(0)
    probs = []
    for _ in range(MAX_UPDATES):
        batch = _collect(policy, env)
        ppo_update(policy, optimizer, batch, LEARNING_CONFIG, generator=generator)
        probs.append(_best_action_prob(policy, batch))
        if probs[-1] > TARGET_PROB:
            break
    assert probs[-1] > TARGET_PROB, f"best-action probability per update: {probs}"
    print(f"reached {probs[-1]:.3f} after {len(probs)} updates")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_masked_mean_over_a_counted_mask_is_the_mean_that_counts_it(dtype: torch.dtype) -> None:
    """``ppo_losses`` counts a minibatch's valid steps once for its seven means; each is
    the mean over the valid entries, bit for bit as if it had counted them itself, and 0
    (not NaN) where none is valid, whatever sits at the invalid ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=dtype)
    valid = torch.rand(4, 6, generator=g) < 0.6
    x[~valid] = float("nan")
    count = valid_count(valid, torch.float32)  # a count in another dtype is converted
    mean = masked_mean(x, valid, count)
    assert mean.dtype == dtype
    assert torch.equal(mean, masked_mean(x, valid))
    torch.testing.assert_close(mean, x[valid].mean())  # (summed in another order)
    none = torch.zeros_like(valid)
    assert masked_mean(x, none, valid_count(none, dtype)) == 0


def test_explained_variance_matches_the_plain_formula_over_valid_entries() -> None:
    from esper.simic.ppo import explained_variance

    g = torch.Generator().manual_seed(0)
    returns = torch.randn(3, 7, generator=g)
    values = returns + 0.5 * torch.randn(3, 7, generator=g)
    valid = torch.rand(3, 7, generator=g) > 0.3
    r, v = returns[valid], values[valid]
    expected = 1 - torch.var(r - v, unbiased=False) / torch.var(r, unbiased=False)
    assert torch.allclose(explained_variance(values, returns, valid), expected, atol=1e-6)
    assert float(explained_variance(returns, returns, valid)) == pytest.approx(1.0)
    constant = torch.ones(3, 7)
    assert float(explained_variance(values, constant, valid)) == 0.0


@pytest.mark.parametrize(
    ("anneal", "expected"), [(True, [1e-3, 0.75e-3, 0.5e-3, 0.25e-3]), (False, [1e-3] * 4)]
)
def test_the_learning_rate_falls_linearly_over_the_run_when_annealed(
    anneal: bool, expected: list[float]
) -> None:
    from esper.simic.schedules import learning_rate_at

    config = PPOConfig(lr=1e-3, anneal_lr=anneal)
    rates = [learning_rate_at(config, update, 4) for update in range(4)]
    assert rates == pytest.approx(expected)


def test_a_non_bool_anneal_lr_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"PPOConfig\.anneal_lr"):
        PPOConfig(anneal_lr=1)  # type: ignore[arg-type]


def test_default_returns_are_final_accuracy_minus_accuracy_then_whatever_the_critic_says() -> None:
    """With the default gamma and lambda the shaped reward's accuracy terms telescope in
    the value targets: from step t the return is final acc - acc before t + final acc
    (terminal), so PPO optimises the figure growth is judged by, not a discounted sum."""
    n_envs, steps = 3, 7
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.5, 1.0, size=(n_envs, steps + 1))  # acc[:, t] before step t
    rewards = []
    for t in range(steps):
        flags = np.zeros(n_envs, dtype=bool)
        inputs = RewardInputs(
            val_acc=acc[:, t + 1],
            prev_val_acc=acc[:, t],
            contribution=np.zeros((n_envs, 1)),
            blending=np.zeros((n_envs, 1), dtype=bool),
            seed_params=np.zeros(n_envs, dtype=np.int64),
            illegal_op=flags,
            wasted_op=flags,
            fossilized=flags,
            terminal=np.full(n_envs, t == steps - 1),
            rollback=flags,
        )
        rewards.append(total(shaped_reward(inputs, RewardConfig())))
    config = PPOConfig()
    g = torch.Generator().manual_seed(0)
    values = torch.randn(n_envs, steps, generator=g, dtype=torch.float64)
    last = torch.zeros(n_envs, steps, dtype=torch.bool)
    last[:, -1] = True
    _, returns = compute_gae(
        torch.from_numpy(np.stack(rewards, axis=1)).double(),
        values,
        torch.cat([values[:, 1:], torch.zeros(n_envs, 1, dtype=torch.float64)], dim=1),
        last,
        last,
        config.gamma,
        config.gae_lambda,
    )
    final = torch.from_numpy(acc[:, -1:])
    expected = (final - torch.from_numpy(acc[:, :-1])) + final
    torch.testing.assert_close(returns, expected, atol=1e-6, rtol=0)


def test_without_the_critic_baseline_paired_advantages_are_the_returns_less_the_others() -> None:
    """RLOO: with critic_baseline off the critic's values play no part in what PPO trains
    on; each env's return is compared with the mean of its group's other envs."""
    batch = _rollout_batch(make_policy(), n_envs=8, n_steps=5)
    config = PPOConfig(critic_baseline=False, pair_size=4)
    rloo = trained_advantages(batch, config)
    for e in range(8):
        group = range(e // 4 * 4, e // 4 * 4 + 4)
        for t in range(5):
            if not batch.valid[e, t]:
                continue
            others = [batch.returns[o, t] for o in group if o != e and batch.valid[o, t]]
            expected = batch.returns[e, t] - torch.stack(others).mean()
            torch.testing.assert_close(rloo[e, t], expected)
    shifted = dataclasses.replace(batch, values=batch.values + 5.0, advantages=batch.advantages - 3)
    torch.testing.assert_close(trained_advantages(shifted, config), rloo)
    with_critic = trained_advantages(
        batch, PPOConfig(pair_size=4, critic_baseline=True, vf_coef=0.5)
    )
    assert not torch.allclose(with_critic, rloo)  # the default subtracts the critic first


def test_dropping_the_critic_baseline_needs_paired_envs_and_says_so() -> None:
    with pytest.raises(ValueError, match=r"PPOConfig\.critic_baseline.*paired_envs"):
        PPOConfig(critic_baseline=False, paired_envs=False)
    PPOConfig(critic_baseline=True, paired_envs=False, vf_coef=0.5)


def test_a_critic_baseline_needs_a_trained_critic_and_says_so() -> None:
    with pytest.raises(ValueError, match=r"PPOConfig\.vf_coef.*untrained"):
        PPOConfig(critic_baseline=True)


def test_each_minibatch_under_autocast_reads_the_weights_the_step_before_left() -> None:
    """A bf16-mixed fit runs the update inside one autocast region, which keeps its casts
    of the weights for the region: without dropping them after each step, every later
    minibatch's forward read the first one's weights. After an update, a forward in the
    same region equals one in a fresh region."""
    policy = make_policy(seed=1)
    batch = _rollout_batch(policy, unbroken=True)
    config = PPOConfig()
    optimizer = make_optimizer(policy, config)

    def values() -> torch.Tensor:
        return policy.evaluate(
            batch.obs, batch.hidden0, batch.masks, batch.actions, batch.episode_starts
        )[2]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ppo_update(policy, optimizer, batch, config)
        inside = values()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = values()
    assert torch.equal(inside, fresh)
