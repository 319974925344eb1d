"""Tamiyo: the controller that decides, once per host epoch, what to do to each slot.

Holds the policy network (LSTM + masked factored heads + value), the action masks it
samples under, the masked categorical those heads use, observation features and a
heuristic controller. It knows nothing of PPO losses: those live in ``esper.simic``.
"""
