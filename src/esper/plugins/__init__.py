"""Plugin discovery: every extensible kind is a :class:`Registry` fed by code and entry points.

Groups: ``esper.blueprints``, ``esper.hosts``, ``esper.datamodules``, ``esper.rewards``,
``esper.callbacks``. Each registry lives with the domain that uses it; this package holds
the mechanism.
"""

from esper.plugins.registry import BUILTIN_SOURCE, PluginError, Registered, Registry

__all__ = ["BUILTIN_SOURCE", "PluginError", "Registered", "Registry"]
