"""Learning: the rollout buffer, GAE, the observation normaliser, the PPO update and the
``PPOModule`` LightningModule that trains the growth policy on the MDP of ``esper.mdp``."""
