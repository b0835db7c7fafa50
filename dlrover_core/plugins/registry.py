"""Typed registries of the records plugins register (backends, savers, templates...).

One :class:`Registry` per record kind; ``RECORD_KINDS`` maps each record type to its
registration hook. The plugin manager fills them (``PluginManager._collect``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Iterator, TypeVar

from dlrover_core.plugins.records import (
    Backend,
    CheckpointSaver,
    GraphTemplate,
    PlacementPolicy,
    StateDictEngine,
    StreamSource,
    Tuner,
)

if TYPE_CHECKING:
    from dlrover_core.plugins.manager import PluginManager

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


class Registry(Generic[R]):
    """The records of one kind that the loaded plugins provide, by name.

    ``registry.get(name)`` raises ``UnknownPluginError`` listing what is installed
    (and which plugins failed or are blocked); ``registry.all()`` (or calling the
    registry) gives ``{name: record}`` sorted by name; ``name in registry`` works.
    Raises ``PluginError`` when two plugins provide the same name.
    """

    def __init__(self, manager: PluginManager, kind: type[R]) -> None:
        self._manager = manager
        self.kind = kind

    def all(self) -> dict[str, R]:
        return dict(sorted(self._manager._collect()[self.kind].items()))

    __call__ = all

    def names(self) -> list[str]:
        return sorted(self._manager._collect()[self.kind])

    def __contains__(self, name: object) -> bool:
        return name in self._manager._collect()[self.kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._manager._collect()[self.kind])

    def get(self, name: str) -> R:
        records = self._manager._collect()[self.kind]
        if name in records:
            return records[name]
        installed = ", ".join(sorted(records)) or "none"
        msg = f"unknown {RECORD_KINDS[self.kind].words} {name!r}; installed: {installed}"
        broken = [i for i in self._manager._infos.values()
                  if i.status in ("failed", "blocked")]
        same = [i for i in broken if i.name == name]
        if same:
            i = same[0]
            msg += f"; plugin {i.name!r} would provide it but is {i.status.value}: {i.error}"
        elif broken:
            msg += "; not loaded: " + ", ".join(f"{i.name} ({i.status.value}: {i.error})"
                                                 for i in broken)
        raise UnknownPluginError(msg)
