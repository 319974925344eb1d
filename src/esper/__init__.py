"""Esper: a PyTorch Lightning trainer for networks that grow during training.

Importing the package stays cheap (no torch import): the domains are imported
where they are used.
"""

__version__ = "0.1.0"
