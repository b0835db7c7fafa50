"""Loads plugins and calls their hooks through typed methods.

Discovery: the entry-point group ``dlrover.plugins`` (entry name = short plugin
name) is loaded with stevedore; a plugin whose import raises is recorded as
``failed`` with its error and skipped. ``DLROVER_DISABLE_PLUGINS=a,b`` blocks
plugins by name (pluggy's ``set_blocked``) before they are imported. The core's
defaults (``dlrover_core.builtin``) are registered through the same hooks under the
name ``builtin``. pluggy (project ``dlrover``) holds the modules and calls the hooks.

Core code calls hooks only through the methods of :class:`PluginManager`: one method
per hook, named like the hook without its ``dlrover_`` prefix
(``dlrover_classify_failure`` -> :meth:`PluginManager.classify_failure`), and one
typed :class:`Registry` per record kind (``pm.backends.get("fsdp")``).
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import pluggy
from stevedore import NamedExtensionManager

from dlrover_core.plugins import hookspecs
from dlrover_core.plugins.info import DISABLE_ENV, PluginInfo, PluginStatus, disabled_plugins
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
from dlrover_core.plugins.registry import (
    RECORD_KINDS,
    PluginError,
    RecordKind,
    Registry,
    UnknownPluginError,
    collect_records,
)

if TYPE_CHECKING:
    from dlrover_core.runtime.workload import BaseWorkload

ENTRY_POINT_GROUP = "dlrover.plugins"
BUILTIN_NAME = "builtin"

R = TypeVar("R")

#: ``emit(event: str, **fields)``: appends an event to the job's ``events.jsonl``.
Emit = Callable[..., Any]


__all__ = ["BUILTIN_NAME", "DISABLE_ENV", "ENTRY_POINT_GROUP", "RECORD_KINDS", "Emit",
           "PluginError", "PluginInfo", "PluginManager", "PluginStatus", "RecordKind",
           "Registry", "UnknownPluginError", "disabled_plugins", "get_plugin_manager",
           "reset_plugin_manager"]


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
        self._records: dict[type, dict[str, Any]] | None = None
        for name in disabled_plugins(env):
            self._pm.set_blocked(name)
        self.templates: Registry[GraphTemplate] = Registry(self, GraphTemplate)
        self.backends: Registry[Backend] = Registry(self, Backend)
        self.state_dict_engines: Registry[StateDictEngine] = Registry(self, StateDictEngine)
        self.savers: Registry[CheckpointSaver] = Registry(self, CheckpointSaver)
        self.placement_policies: Registry[PlacementPolicy] = Registry(self, PlacementPolicy)
        self.tuners: Registry[Tuner] = Registry(self, Tuner)
        self.stream_sources: Registry[StreamSource] = Registry(self, StreamSource)
        from dlrover_core.builtin import plugin as builtin_plugin

        self.register(
            builtin_plugin,
            name=BUILTIN_NAME,
            distribution="dlrover-core",
            version=_dist_version("dlrover-core"),
        )
        if load_entry_points:
            self._load_entry_points()

    def registry(self, kind: type[R]) -> Registry[R]:
        """The registry of any record kind in ``RECORD_KINDS`` (``pm.registry(Backend)``
        is ``pm.backends``)."""
        if kind not in RECORD_KINDS:
            raise KeyError(f"{kind!r} is not a record kind; known: "
                           f"{', '.join(k.__name__ for k in RECORD_KINDS)}")
        return Registry(self, kind)

    # ------------------------------------------------------------------ loading
    def is_blocked(self, name: str) -> bool:
        """True when ``name`` is blocked (``DLROVER_DISABLE_PLUGINS``)."""
        return self._pm.is_blocked(name)

    def register(
        self, module: Any, name: str, distribution: str = "", version: str = ""
    ) -> PluginInfo:
        """Register a plugin module (or object) under ``name``; returns its info.

        A blocked name is recorded as ``blocked`` and not registered. A registration
        that raises (a bad hookimpl signature) is recorded as ``failed``.
        """
        info = PluginInfo(name=name, version=version, distribution=distribution)
        self._infos[name] = info
        try:
            registered = self._pm.register(module, name=name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the master
            info.fail(f"{type(exc).__name__}: {exc}")
            return info
        if registered is None:  # pluggy refuses blocked names
            info.status, info.error = PluginStatus.BLOCKED, f"blocked by {DISABLE_ENV}"
            return info
        info.module = module
        info.hooks = [h.name for h in self._pm.get_hookcallers(module) or []]
        self._stamp_classifier(module, name)
        self._records = None
        return info

    def _stamp_classifier(self, module: Any, name: str) -> None:
        """Make the plugin's ``dlrover_classify_failure`` answer carry its name in
        ``FailureVerdict.classifier`` (unless it set one), so that the verdict of
        pluggy's ``firstresult`` call says which plugin answered."""
        for impl in self._pm.hook.dlrover_classify_failure.get_hookimpls():
            if impl.plugin is not module:
                continue
            inner = impl.function

            def stamped(*args: Any, _inner: Any = inner) -> FailureVerdict | None:
                verdict = _inner(*args)
                if verdict is not None and not verdict.classifier:
                    verdict = replace(verdict, classifier=name)
                return verdict

            impl.function = stamped  # type: ignore[misc] - argnames stay the original's

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
            info = self._infos[ep.name] = PluginInfo(
                name=ep.name, version=dist_version, distribution=dist_name
            )
            if self._pm.is_blocked(ep.name):  # never imported
                info.status, info.error = PluginStatus.BLOCKED, f"blocked by {DISABLE_ENV}"
            else:
                wanted.append(ep.name)
        if not wanted:
            return

        def on_failure(_mgr: Any, ep: Any, exc: BaseException) -> None:
            self._infos[ep.name].fail(f"{type(exc).__name__}: {exc}")

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
            if name not in loaded and info.status == PluginStatus.ACTIVE:
                info.fail("entry point not found by stevedore")

    # ------------------------------------------------------------------ inspection
    def plugins(self) -> list[PluginInfo]:
        """All plugins, sorted by name, with ``provides`` filled in."""
        try:
            self._collect()
        except PluginError:
            pass  # clashes are reported when a record is selected
        return [self._infos[n] for n in sorted(self._infos)]

    def _collect(self) -> dict[type, dict[str, Any]]:
        """Call every registration hook once per plugin (to know who provided what);
        cached until the next :meth:`register`."""
        if self._records is not None:
            return self._records
        records, clashes = collect_records(self._pm, self._infos)
        self._records = records  # kept: a clash is raised once, then the first provider wins
        if clashes:
            raise PluginError("; ".join(clashes) + f"; disable one with {DISABLE_ENV}")
        return records

    # ------------------------------------------------------------------ RecordSource
    def collected(self) -> dict[type, dict[str, Any]]:
        """record type -> {name: record} (what a :class:`Registry` reads)."""
        return self._collect()

    def not_loaded(self) -> list[PluginInfo]:
        """The plugins that failed or are blocked."""
        return [i for i in self._infos.values()
                if i.status in (PluginStatus.FAILED, PluginStatus.BLOCKED)]

    # ------------------------------------------------------------------ older spellings
    # ``pm.get_backend(name)`` is ``pm.backends.get(name)``; kept for existing callers.
    def get_template(self, name: str) -> GraphTemplate:
        return self.templates.get(name)

    def get_backend(self, name: str) -> Backend:
        return self.backends.get(name)

    def get_state_dict_engine(self, name: str) -> StateDictEngine:
        return self.state_dict_engines.get(name)

    def get_saver(self, name: str) -> CheckpointSaver:
        return self.savers.get(name)

    def get_placement_policy(self, name: str) -> PlacementPolicy:
        return self.placement_policies.get(name)

    def get_tuner(self, name: str) -> Tuner:
        return self.tuners.get(name)

    def get_stream_source(self, name: str) -> StreamSource:
        return self.stream_sources.get(name)

    # ------------------------------------------------------------------ hook calls
    def cli_commands(self, cli: Any) -> None:
        """``dlrover_cli_commands``: plugins add sub-commands to ``cli`` (argparse
        sub-parsers). Client process."""
        self._pm.hook.dlrover_cli_commands(cli=cli)

    add_cli_commands = cli_commands  # older spelling

    def classify_failure(self, failure: Failure,
                         history: Iterable[Failure] = ()) -> FailureVerdict:
        """``dlrover_classify_failure`` (pluggy ``firstresult``): the first plugin that
        answers wins; the built-in classifier answers last. ``classifier`` names the
        plugin that answered.

        Raises:
            PluginError: nobody answered (the builtin plugin is blocked).
        """
        verdict = self._pm.hook.dlrover_classify_failure(failure=failure,
                                                         history=list(history))
        if verdict is None:
            raise PluginError("no failure classifier answered (is the builtin plugin "
                              "disabled?)")
        return verdict

    def workload_setup(self, workload: BaseWorkload) -> None:
        """``dlrover_workload_setup``. Worker process."""
        self._pm.hook.dlrover_workload_setup(workload=workload)

    def workload_started(self, workload: BaseWorkload) -> None:
        """``dlrover_workload_started``. Worker process."""
        self._pm.hook.dlrover_workload_started(workload=workload)

    def step_reported(self, job: str, role: str, rank: int, step: int,
                      metrics: dict[str, float]) -> None:
        """``dlrover_step_reported``. Master process."""
        self._pm.hook.dlrover_step_reported(job=job, role=role, rank=rank, step=step,
                                            metrics=metrics)

    def workload_stopped(self, job: str, role: str, rank: int, status: str) -> None:
        """``dlrover_workload_stopped`` (``status``: ``succeeded`` or ``stopped``). Master."""
        self._pm.hook.dlrover_workload_stopped(job=job, role=role, rank=rank, status=status)

    def workload_failed(self, job: str, failure: Failure, verdict: FailureVerdict,
                        emit: Emit | None = None) -> None:
        """``dlrover_workload_failed``, before the recovery starts. Master process."""
        self._pm.hook.dlrover_workload_failed(job=job, failure=failure, verdict=verdict,
                                              emit=emit or _no_emit)

    def job_finished(self, job: str, summary: dict, emit: Emit | None = None,
                     spec: Any = None) -> None:
        """``dlrover_job_finished``, before the ``job_finished`` event. Master process."""
        self._pm.hook.dlrover_job_finished(job=job, summary=summary, emit=emit or _no_emit,
                                           spec=spec)

    def job_health(self, job: str, spec: Any) -> dict[str, dict]:
        """``dlrover_job_health``: the failing checks of every plugin merged
        (``{check: details}``; a name two plugins answer is kept once, the first
        answer). Master process."""
        out: dict[str, dict] = {}
        for answer in self._pm.hook.dlrover_job_health(job=job, spec=spec):
            for check, details in (answer or {}).items():
                out.setdefault(str(check), dict(details or {}))
        return out

    def job_deleted(self, job: str, job_dir: str) -> list[str]:
        """``dlrover_job_deleted``: what the plugins removed for a deleted job (one line
        each). Client process."""
        return [line for lines in self._pm.hook.dlrover_job_deleted(job=job, job_dir=job_dir)
                for line in (lines or [])]


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
