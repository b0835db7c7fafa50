"""Loads plugins and calls their hooks through typed methods.

Discovery: the entry-point group ``dlrover.plugins`` (entry name = short plugin
name) is loaded with stevedore; a plugin whose import raises is recorded as
``failed`` with its error and skipped. ``DLROVER_DISABLE_PLUGINS=a,b`` blocks
plugins by name before they are imported. The core's defaults
(``dlrover_core.builtin``) are registered through the same hooks under the name
``builtin``. pluggy (project ``dlrover``) holds the modules and calls the hooks.

Core code calls hooks only through the methods of :class:`PluginManager`.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, TypeVar

import pluggy
from stevedore import NamedExtensionManager

from dlrover_core.plugins import hookspecs
from dlrover_core.plugins.records import (
    Backend,
    CheckpointSaver,
    Failure,
    FailureVerdict,
    GraphTemplate,
    PlacementPolicy,
    StateDictEngine,
    StreamSource,
    Tuner,
)

ENTRY_POINT_GROUP = "dlrover.plugins"
DISABLE_ENV = "DLROVER_DISABLE_PLUGINS"
BUILTIN_NAME = "builtin"

R = TypeVar("R")


class PluginError(RuntimeError):
    """A plugin is broken or two plugins clash."""


class UnknownPluginError(LookupError):
    """A job selected a template, backend, saver, policy or tuner nobody provides."""


@dataclass
class PluginInfo:
    """One plugin as ``dlrover plugins list`` shows it.

    ``status`` is ``active`` (loaded and registered), ``blocked`` (named in
    ``DLROVER_DISABLE_PLUGINS``, never imported) or ``failed`` (its import or
    registration raised; ``error`` holds the exception).
    """

    name: str
    version: str = ""
    distribution: str = ""
    hooks: list[str] = field(default_factory=list)
    provides: list[str] = field(default_factory=list)
    status: str = "active"
    error: str = ""
    module: Any = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "distribution": self.distribution,
            "hooks": sorted(self.hooks),
            "provides": sorted(self.provides),
            "status": self.status,
            "error": self.error,
        }


def disabled_plugins(env: dict | None = None) -> set[str]:
    """Names listed in ``DLROVER_DISABLE_PLUGINS`` (comma separated)."""
    raw = (env if env is not None else os.environ).get(DISABLE_ENV, "")
    return {n.strip() for n in raw.split(",") if n.strip()}


_KINDS: dict[str, tuple[str, type]] = {
    # kind label -> (registration hook, record type)
    "template": ("dlrover_graph_templates", GraphTemplate),
    "backend": ("dlrover_backends", Backend),
    "engine": ("dlrover_state_dict_engines", StateDictEngine),
    "saver": ("dlrover_checkpoint_savers", CheckpointSaver),
    "placement": ("dlrover_placement_policies", PlacementPolicy),
    "tuner": ("dlrover_tuners", Tuner),
    "stream_source": ("dlrover_stream_sources", StreamSource),
}

_KIND_WORDS = {
    "template": "graph template",
    "backend": "backend",
    "engine": "state-dict engine",
    "saver": "checkpoint saver",
    "placement": "placement policy",
    "tuner": "tuner",
    "stream_source": "stream source",
}


class PluginManager:
    """The plugins of this process and typed access to their hooks.

    Args:
        load_entry_points: discover ``dlrover.plugins`` entry points (tests turn it off
            and register modules by hand with :meth:`register`).
        env: environment to read ``DLROVER_DISABLE_PLUGINS`` from (default ``os.environ``).
    """

    def __init__(self, load_entry_points: bool = True, env: dict | None = None) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._infos: dict[str, PluginInfo] = {}
        self._records: dict[str, dict[str, Any]] | None = None
        self._blocked = disabled_plugins(env)
        from dlrover_core.builtin import plugin as builtin_plugin

        self.register(
            builtin_plugin,
            name=BUILTIN_NAME,
            distribution="dlrover-core",
            version=_dist_version("dlrover-core"),
        )
        if load_entry_points:
            self._load_entry_points()

    # ------------------------------------------------------------------ loading
    def register(
        self, module: Any, name: str, distribution: str = "", version: str = ""
    ) -> PluginInfo:
        """Register a plugin module (or object) under ``name``; returns its info.

        A blocked name is recorded as ``blocked`` and not registered. A registration
        that raises (a bad hookimpl signature) is recorded as ``failed``.
        """
        info = PluginInfo(name=name, version=version, distribution=distribution)
        self._infos[name] = info
        if name in self._blocked:
            info.status = "blocked"
            info.error = f"blocked by {DISABLE_ENV}"
            return info
        try:
            self._pm.register(module, name=name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the master
            info.status = "failed"
            info.error = f"{type(exc).__name__}: {exc}"
            return info
        info.module = module
        info.hooks = [h.name for h in self._pm.get_hookcallers(module) or []]
        self._records = None
        return info

    def _load_entry_points(self) -> None:
        eps = sorted(
            importlib_metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
        )
        wanted = []
        for ep in eps:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else ""
            dist_version = dist.version if dist is not None else ""
            if ep.name in self._infos and self._infos[ep.name].distribution != dist_name:
                raise PluginError(
                    f"plugin name {ep.name!r} is registered by both "
                    f"{self._infos[ep.name].distribution or 'dlrover-core'} and {dist_name}"
                )
            self._infos[ep.name] = PluginInfo(
                name=ep.name, version=dist_version, distribution=dist_name
            )
            if ep.name in self._blocked:
                self._infos[ep.name].status = "blocked"
                self._infos[ep.name].error = f"blocked by {DISABLE_ENV}"
            else:
                wanted.append(ep.name)
        if not wanted:
            return

        def on_failure(_mgr: Any, ep: Any, exc: BaseException) -> None:
            info = self._infos[ep.name]
            info.status = "failed"
            info.error = f"{type(exc).__name__}: {exc}"

        # stevedore caches entry points per namespace for the life of the process;
        # drop it so that distributions installed since then are seen
        NamedExtensionManager.ENTRY_POINT_CACHE.pop(ENTRY_POINT_GROUP, None)
        mgr = NamedExtensionManager(
            namespace=ENTRY_POINT_GROUP,
            names=wanted,
            invoke_on_load=False,
            on_load_failure_callback=on_failure,
        )
        loaded = set()
        for ext in mgr.extensions:
            info = self._infos[ext.name]
            self.register(ext.plugin, ext.name, info.distribution, info.version)
            loaded.add(ext.name)
        for name in wanted:
            info = self._infos[name]
            if name not in loaded and info.status == "active":
                info.status = "failed"
                info.error = "entry point not found by stevedore"

    # ------------------------------------------------------------------ inspection
    def plugins(self) -> list[PluginInfo]:
        """All plugins, sorted by name, with ``provides`` filled in."""
        try:
            self._collect()
        except PluginError:
            pass  # clashes are reported when a record is selected
        return [self._infos[n] for n in sorted(self._infos)]

    def _collect(self) -> dict[str, dict[str, Any]]:
        if self._records is not None:
            return self._records
        records: dict[str, dict[str, Any]] = {k: {} for k in _KINDS}
        for info in self._infos.values():
            info.provides = []
        clashes = []
        for kind, (hook_name, rtype) in _KINDS.items():
            caller = getattr(self._pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                plugin_name = self._pm.get_name(impl.plugin) or "?"
                info = self._infos.get(plugin_name)
                try:
                    result = impl.function()
                except Exception as exc:  # noqa: BLE001
                    if info is not None:
                        info.status = "failed"
                        info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
                    continue
                for rec in result or []:
                    if not isinstance(rec, rtype):
                        if info is not None:
                            info.status = "failed"
                            info.error = (
                                f"{hook_name} returned {type(rec).__name__}, expected {rtype.__name__}"
                            )
                        continue
                    rec = replace(rec, provider=plugin_name)
                    if rec.name in records[kind]:
                        a, b = sorted((records[kind][rec.name].provider, plugin_name))
                        clashes.append(
                            f"{_KIND_WORDS[kind]} {rec.name!r} is provided by both "
                            f"plugin {a!r} and plugin {b!r}"
                        )
                        continue
                    records[kind][rec.name] = rec
                    if info is not None:
                        info.provides.append(f"{kind}:{rec.name}")
        self._records = records
        if clashes:
            raise PluginError("; ".join(clashes) + f"; disable one with {DISABLE_ENV}")
        return records

    def _all(self, kind: str) -> dict[str, Any]:
        return dict(sorted(self._collect()[kind].items()))

    def _get(self, kind: str, name: str) -> Any:
        records = self._collect()[kind]
        if name in records:
            return records[name]
        installed = ", ".join(sorted(records)) or "none"
        msg = f"unknown {_KIND_WORDS[kind]} {name!r}; installed: {installed}"
        broken = [i for i in self._infos.values() if i.status in ("failed", "blocked")]
        same = [i for i in broken if i.name == name]
        if same:
            i = same[0]
            msg += f"; plugin {i.name!r} would provide it but is {i.status}: {i.error}"
        elif broken:
            msg += "; not loaded: " + ", ".join(f"{i.name} ({i.status}: {i.error})" for i in broken)
        raise UnknownPluginError(msg)

    # ------------------------------------------------------------------ registries
    def templates(self) -> dict[str, GraphTemplate]:
        return self._all("template")

    def get_template(self, name: str) -> GraphTemplate:
        """Raises ``UnknownPluginError`` listing the installed templates."""
        return self._get("template", name)

    def backends(self) -> dict[str, Backend]:
        return self._all("backend")

    def get_backend(self, name: str) -> Backend:
        return self._get("backend", name)

    def state_dict_engines(self) -> dict[str, StateDictEngine]:
        return self._all("engine")

    def get_state_dict_engine(self, name: str) -> StateDictEngine:
        return self._get("engine", name)

    def savers(self) -> dict[str, CheckpointSaver]:
        return self._all("saver")

    def get_saver(self, name: str) -> CheckpointSaver:
        return self._get("saver", name)

    def placement_policies(self) -> dict[str, PlacementPolicy]:
        return self._all("placement")

    def get_placement_policy(self, name: str) -> PlacementPolicy:
        return self._get("placement", name)

    def tuners(self) -> dict[str, Tuner]:
        return self._all("tuner")

    def get_tuner(self, name: str) -> Tuner:
        return self._get("tuner", name)

    def stream_sources(self) -> dict[str, StreamSource]:
        return self._all("stream_source")

    def get_stream_source(self, name: str) -> StreamSource:
        """Raises ``UnknownPluginError`` listing the installed stream sources."""
        return self._get("stream_source", name)

    # ------------------------------------------------------------------ calls
    def add_cli_commands(self, subparsers: Any) -> None:
        self._pm.hook.dlrover_cli_commands(cli=subparsers)

    def classify_failure(self, failure: Failure, history: Iterable[Failure] = ()) -> FailureVerdict:
        """The first plugin verdict; the built-in classifier answers last."""
        for impl in reversed(self._pm.hook.dlrover_classify_failure.get_hookimpls()):
            verdict = impl.function(failure=failure, history=list(history))
            if verdict is not None:
                name = self._pm.get_name(impl.plugin) or "?"
                return replace(verdict, classifier=verdict.classifier or name)
        raise PluginError("no failure classifier answered (is the builtin plugin disabled?)")

    def workload_setup(self, workload: Any) -> None:
        self._pm.hook.dlrover_workload_setup(workload=workload)

    def workload_started(self, workload: Any) -> None:
        self._pm.hook.dlrover_workload_started(workload=workload)

    def step_reported(self, job: str, role: str, rank: int, step: int, metrics: dict) -> None:
        self._pm.hook.dlrover_step_reported(job=job, role=role, rank=rank, step=step, metrics=metrics)

    def workload_stopped(self, job: str, role: str, rank: int, status: str) -> None:
        self._pm.hook.dlrover_workload_stopped(job=job, role=role, rank=rank, status=status)

    def workload_failed(self, job: str, failure: Failure, verdict: FailureVerdict,
                        emit: Any = None) -> None:
        self._pm.hook.dlrover_workload_failed(job=job, failure=failure, verdict=verdict,
                                              emit=emit or _no_emit)

    def job_finished(self, job: str, summary: dict, emit: Any = None) -> None:
        self._pm.hook.dlrover_job_finished(job=job, summary=summary, emit=emit or _no_emit)


def _no_emit(event: str, **fields: Any) -> None:
    """The ``emit`` hooks get outside a JobMaster: events go nowhere."""


def _dist_version(dist: str) -> str:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return ""


_lock = threading.Lock()
_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, created on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager(manager: PluginManager | None = None) -> None:
    """Replace (or drop) the process-wide manager; used by tests and after installs."""
    global _manager
    with _lock:
        _manager = manager
