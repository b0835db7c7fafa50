"""Typed registries of the records plugins register (backends, savers, templates...).

One :class:`Registry` per record kind; ``RECORD_KINDS`` maps each record type to its
registration hook. A registry reads its records from a :class:`RecordSource` (the plugin
manager is one), so this module does not import the manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Iterator, Protocol, TypeVar

from dlrover_core.plugins.records import (
    Backend,
    CheckpointSaver,
    GraphTemplate,
    PlacementPolicy,
    StateDictEngine,
    StreamSource,
    Tuner,
)

R = TypeVar("R")


class PluginError(RuntimeError):
    """A plugin is broken or two plugins clash."""


class UnknownPluginError(LookupError):
    """A job selected a template, backend, saver, policy or tuner nobody provides."""


@dataclass(frozen=True)
class RecordKind:
    """A kind of registered record: its registration ``hook``, the short ``label`` used
    in ``PluginInfo.provides`` (``backend:fsdp``) and the ``words`` of error messages."""

    hook: str
    label: str
    words: str


#: Record type -> its kind. A new kind: a frozen record type in ``records``, a
#: registration hookspec returning a list of them, and one entry here; then
#: ``pm.registry(NewRecord)`` works.
RECORD_KINDS: dict[type, RecordKind] = {
    GraphTemplate: RecordKind("dlrover_graph_templates", "template", "graph template"),
    Backend: RecordKind("dlrover_backends", "backend", "backend"),
    StateDictEngine: RecordKind("dlrover_state_dict_engines", "engine", "state-dict engine"),
    CheckpointSaver: RecordKind("dlrover_checkpoint_savers", "saver", "checkpoint saver"),
    PlacementPolicy: RecordKind("dlrover_placement_policies", "placement", "placement policy"),
    Tuner: RecordKind("dlrover_tuners", "tuner", "tuner"),
    StreamSource: RecordKind("dlrover_stream_sources", "stream_source", "stream source"),
}


class RecordSource(Protocol):
    """Where a :class:`Registry` reads from (:class:`~dlrover_core.plugins.manager.PluginManager`
    is one)."""

    def collected(self) -> dict[type, dict[str, Any]]:
        """record type -> {name: record} over every loaded plugin.

        Raises:
            PluginError: two plugins provide the same name.
        """

    def not_loaded(self) -> list[Any]:
        """The plugins that failed or are blocked: objects with ``name``, ``status``
        (a string enum: ``failed`` / ``blocked``) and ``error``."""


class Registry(Generic[R]):
    """The records of one kind that the loaded plugins provide, by name.

    ``registry.get(name)`` raises ``UnknownPluginError`` listing what is installed
    (and which plugins failed or are blocked); ``registry.all()`` (or calling the
    registry) gives ``{name: record}`` sorted by name; ``name in registry`` works.
    Raises ``PluginError`` when two plugins provide the same name.
    """

    def __init__(self, source: RecordSource, kind: type[R]) -> None:
        self._source = source
        self.kind = kind

    def all(self) -> dict[str, R]:
        return dict(sorted(self._source.collected()[self.kind].items()))

    __call__ = all

    def names(self) -> list[str]:
        return sorted(self._source.collected()[self.kind])

    def __contains__(self, name: object) -> bool:
        return name in self._source.collected()[self.kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._source.collected()[self.kind])

    def get(self, name: str) -> R:
        records = self._source.collected()[self.kind]
        if name in records:
            return records[name]
        installed = ", ".join(sorted(records)) or "none"
        msg = f"unknown {RECORD_KINDS[self.kind].words} {name!r}; installed: {installed}"
        broken = self._source.not_loaded()
        same = [i for i in broken if i.name == name]
        if same:
            i = same[0]
            msg += f"; plugin {i.name!r} would provide it but is {i.status.value}: {i.error}"
        elif broken:
            msg += "; not loaded: " + ", ".join(f"{i.name} ({i.status.value}: {i.error})"
                                                 for i in broken)
        raise UnknownPluginError(msg)
