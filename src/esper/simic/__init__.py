"""PPO: the vectorized env, rollouts, GAE, rewards, the observation normalizer and the update."""
