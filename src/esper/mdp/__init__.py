"""The growth MDP: the vectorised env, its config and pairing, rewards, the step's packed
read, the governor's mechanics and the rollout loop that collects transitions.

It knows nothing of learning: what a rollout is finished into (GAE, the normaliser, the
PPO update) lives in ``esper.simic``, which imports this package, never the reverse.
"""
