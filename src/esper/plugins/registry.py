"""A name -> object registry that also loads Python entry points.

Built-ins register in code; third-party packages add to the same namespace through
an entry-point group (``esper.blueprints`` and friends) without touching Esper. Entry
points load lazily, on the first lookup, so importing Esper never imports plugins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

T = TypeVar("T")

BUILTIN_SOURCE = "esper (built-in)"


class PluginError(RuntimeError):
    """A plugin could not be registered or loaded; the message names it and its distribution."""


@dataclass(frozen=True)
class Registered(Generic[T]):
    name: str
    obj: T
    source: str  # "esper (built-in)" or "distribution-name version"


def _distribution_of(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"{dist.metadata['Name']} {dist.version}"


class Registry(Generic[T]):
    """Plugins of one kind (``kind``, e.g. "blueprint") from code and entry-point ``group``."""

    def __init__(
        self,
        group: str,
        kind: str,
        validate: Callable[[str, object], T] | None = None,
    ) -> None:
        self.group = group
        self.kind = kind
        self._validate = validate
        self._entries: dict[str, Registered[T]] = {}
        self._entry_points_loaded = False

    def register(self, name: str, obj: T, *, source: str = BUILTIN_SOURCE) -> T:
        """Add ``obj`` under ``name``; a second object under the same name is an error."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise PluginError(
                f"{self.kind} name {name!r} from {source} is not a valid name: "
                "use letters, digits, '_' and '-'"
            )
        if self._validate is not None:
            obj = self._validate(name, obj)
        existing = self._entries.get(name)
        if existing is not None and existing.obj is not obj:
            raise PluginError(
                f"duplicate {self.kind} {name!r}: registered by {existing.source} "
                f"and again by {source}; rename one of them (entry-point group {self.group!r})"
            )
        self._entries[name] = Registered(name, obj, source)
        return obj

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        # All or nothing: if one plugin fails, roll back the others so that the next lookup
        # raises the same error again instead of silently answering from a partial registry.
        before = dict(self._entries)
        self._entry_points_loaded = True
        try:
            self._register_entry_points()
        except BaseException:
            self._entries = before
            self._entry_points_loaded = False
            raise

    def _register_entry_points(self) -> None:
        for ep in entry_points(group=self.group):
            source = _distribution_of(ep)
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"{self.kind} plugin {ep.name!r} from {source} failed to load "
                    f"(entry point {ep.value!r} in group {self.group!r}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            try:
                self.register(ep.name, obj, source=source)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"{self.kind} plugin {ep.name!r} from {source} is not a valid {self.kind}: "
                    f"{exc}"
                ) from exc

    def reload_entry_points(self) -> None:
        """Forget entry-point plugins and look them up again (after installing a plugin)."""
        self._entries = {k: v for k, v in self._entries.items() if v.source == BUILTIN_SOURCE}
        self._entry_points_loaded = False
        self._load_entry_points()

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def entry(self, name: str) -> Registered[T]:
        self._load_entry_points()
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise KeyError(
                f"unknown {self.kind} {name!r}; known {self.kind}s: {known}. "
                f"Plugins add more through the entry-point group {self.group!r}."
            ) from None

    def names(self) -> tuple[str, ...]:
        self._load_entry_points()
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
