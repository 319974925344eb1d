"""Growers against the controls a researcher asks for, on paired episodes (``esper evaluate``).

Episodes run through the growth MDP (``esper.mdp``) with a store that keeps no
transitions and a frozen normaliser: evaluation learns nothing.
"""
