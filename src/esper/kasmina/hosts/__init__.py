"""Host networks and their registry (entry-point group ``esper.hosts``).

A host plugin is a :class:`HostModel` subclass; it is built with keyword arguments from
the config.
"""

from __future__ import annotations

from esper.kasmina.hosts.base import HostModel
from esper.kasmina.hosts.cnn import CNNHost
from esper.kasmina.hosts.transformer import TransformerHost
from esper.plugins import Registry


def _as_host_class(name: str, obj: object) -> type[HostModel]:
    if not (isinstance(obj, type) and issubclass(obj, HostModel)):
        raise TypeError(f"expected a subclass of esper.kasmina.hosts.HostModel, got {obj!r}")
    return obj


HOSTS: Registry[type[HostModel]] = Registry("esper.hosts", "host", validate=_as_host_class)
HOSTS.register("cnn", CNNHost)
HOSTS.register("transformer", TransformerHost)

__all__ = ["HOSTS", "CNNHost", "HostModel", "TransformerHost"]
