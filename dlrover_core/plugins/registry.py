"""Typed registries of the records plugins register (backends, savers, templates...).

One :class:`Registry` per record kind; ``RECORD_KINDS`` maps each record type to its
registration hook. A registry reads its records from a :class:`RecordSource` (the plugin
manager is one), so this module does not import the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generic, Iterator, Protocol, TypeVar

from dlrover_core.plugins.info import PluginInfo
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


def collect_records(pm: Any, infos: dict[str, PluginInfo]
                    ) -> tuple[dict[type, dict[str, Any]], list[str]]:
    """Call every registration hook of ``RECORD_KINDS`` once per plugin of the pluggy
    manager ``pm``: returns record type -> {name: record} (each record's ``provider``
    set to the plugin's name) and the clashes (a name provided twice; the first
    provider keeps it). ``infos`` (plugin name -> info) get their ``provides``; a
    hook that raises or returns something other than its record type marks its
    plugin ``failed``."""
    records: dict[type, dict[str, Any]] = {k: {} for k in RECORD_KINDS}
    for info in infos.values():
        info.provides = []
    clashes = []
    for rtype, kind in RECORD_KINDS.items():
        caller = getattr(pm.hook, kind.hook)
        for impl in caller.get_hookimpls():
            plugin_name = pm.get_name(impl.plugin) or "?"
            info = infos.get(plugin_name)
            try:
                result = impl.function()
            except Exception as exc:  # noqa: BLE001
                if info is not None:
                    info.fail(f"{kind.hook} raised {type(exc).__name__}: {exc}")
                continue
            for rec in result or []:
                if not isinstance(rec, rtype):
                    if info is not None:
                        info.fail(f"{kind.hook} returned {type(rec).__name__}, expected "
                                  f"{rtype.__name__}")
                    continue
                rec = replace(rec, provider=plugin_name)
                if rec.name in records[rtype]:
                    a, b = sorted((records[rtype][rec.name].provider, plugin_name))
                    clashes.append(f"{kind.words} {rec.name!r} is provided by both "
                                   f"plugin {a!r} and plugin {b!r}")
                    continue
                records[rtype][rec.name] = rec
                if info is not None:
                    info.provides.append(f"{kind.label}:{rec.name}")
    return records, clashes


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
