"""``Checkpointer``: what a workload uses to save and restore, over the job's saver and
its backend's state-dict engine."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from dlrover_core.checkpoint.engine import PlainEngine, StateDictEngineBase
from dlrover_core.checkpoint.heal import LiveTracker
from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext, step_dir_name
from dlrover_core.runtime import attempt_log

if TYPE_CHECKING:
    from dlrover_core.runtime.context import WorkerContext

log = logging.getLogger(__name__)


def checkpoint_classes(ctx: WorkerContext, plugins: Any) -> tuple[type, type | None]:
    """``(saver class, state-dict engine class)`` of a role instance: the saver of the
    job's ``checkpoint.saver`` (default ``disk``) and the engine of the role's backend
    (``None`` without a backend), imported from their plugins (``plugins``: the
    process's ``PluginManager``).

    Raises:
        UnknownPluginError: the job's saver or engine is not installed.
    """
    from dlrover_core.plugins.records import resolve

    saver_cls = resolve(plugins.savers.get(ctx.checkpoint.get("saver", "disk")).saver)
    if not ctx.backend:
        return saver_cls, None
    engine_name = plugins.backends.get(ctx.backend).state_dict_engine
    return saver_cls, resolve(plugins.state_dict_engines.get(engine_name).engine)


def saver_config(ctx: WorkerContext) -> SaverConfig:
    """The :class:`SaverConfig` of a role instance: ``checkpoint.dir`` (default ``<job
    dir>/ckpt``) joined with the role, ``keep`` (3), the job, ``checkpoint.options``, the
    run id and the job directory."""
    ck = ctx.checkpoint
    directory = os.path.join(ck.get("dir") or os.path.join(ctx.job_dir, "ckpt"), ctx.role)
    return SaverConfig(dir=directory, keep=int(ck.get("keep", 3)), job=ctx.job,
                       options=dict(ck.get("options") or {}), run_id=ctx.run_id,
                       job_dir=ctx.job_dir)


def saver_context(ctx: WorkerContext) -> SaverContext:
    """The :class:`SaverContext` of a role instance (``distributed``: a torch.distributed
    group is up in this process now)."""
    import torch.distributed as dist

    return SaverContext(rank=ctx.rank, world_size=ctx.world_size, local_rank=ctx.local_rank,
                        role=ctx.role, distributed=dist.is_available() and dist.is_initialized())


class Checkpointer:
    """Save / load named objects of one rank.

    Example (inside a workload)::

        step = self.checkpointer.load(model=model, optimizer=opt, extra=extra) or 0
        ...
        self.checkpointer.maybe_save(step, model=model, optimizer=opt, extra=extra)

    Args:
        saver: the job's saver. engine: the backend's state-dict engine.
        every_steps: interval of :meth:`maybe_save` (0: never).
        on_saved: ``on_saved(step, seconds)`` after each save.
        on_loaded: ``on_loaded(step, source, path)`` after a load found a checkpoint
            (``source``: the saver's ``last_load_source``, ``"peer"`` after a heal;
            ``path``: the step's directory, ``""`` after a heal).
        heal: ``heal(objects)``, run by the first :meth:`load` without a ``step``
            instead of the saver when it returns a step (a replicated rank healed from
            a survivor's live state: :mod:`dlrover_core.checkpoint.heal`).
        track_live: note the objects of every save/maybe_save as the live state
            (:meth:`live_state`; default off: a heal needs a ``WorkloadHost``);
            :meth:`for_worker` turns it on only for a backend whose ranks hold the
            whole state (``replicated_state``: DDP).
    """

    def __init__(self, saver: Saver, engine: StateDictEngineBase | None = None,
                 every_steps: int = 0, on_saved: Any = None, on_loaded: Any = None,
                 heal: Any = None, track_live: bool = False) -> None:
        self.saver = saver
        self.engine = engine or PlainEngine()
        self.every_steps = every_steps
        self._on_saved = on_saved
        self._on_loaded = on_loaded
        self._heal = heal
        self.last_save_s = 0.0
        self.last_step: int | None = None
        #: the newest state handed to save/maybe_save (:meth:`live_state`)
        self.live = LiveTracker()
        self.track_live = track_live

    @classmethod
    def for_worker(cls, ctx: WorkerContext, workload: Any = None,
                   plugins: Any = None) -> Checkpointer:
        """The checkpointer a role instance gets from the job spec.

        Args:
            ctx: the instance's context (``checkpoint`` section, role, rank, job dir).
            workload: the workload; its JobMaster is told about each save.
            plugins: the process's ``PluginManager`` (looks up the saver, the backend
                and its state-dict engine); default: the one the ``WorkloadHost`` gave
                the workload (``workload._plugins``).

        Raises:
            ValueError: no plugin manager was given and the workload has none.
            UnknownPluginError: the job's saver or engine is not installed.
        """
        pm = plugins if plugins is not None else getattr(workload, "_plugins", None)
        if pm is None:
            raise ValueError("Checkpointer.for_worker: no plugin manager; pass plugins= or run "
                             "the workload in a WorkloadHost (which sets workload._plugins)")
        ck = ctx.checkpoint
        saver_cls, engine_cls = checkpoint_classes(ctx, pm)
        saver = saver_cls(saver_config(ctx), saver_context(ctx))
        engine: StateDictEngineBase = engine_cls() if engine_cls is not None else PlainEngine()

        def on_saved(step: int, seconds: float) -> None:
            master = workload._master_or_none() if workload is not None else None
            if master is not None:
                master.checkpoint_saved.remote(ctx.role, ctx.rank, step, seconds)

        def on_loaded(step: int, source: str | None, path: str) -> None:
            master = workload._master_or_none() if workload is not None else None
            if master is not None:
                master.checkpoint_loaded.remote(ctx.role, ctx.rank, step, source, path,
                                                ctx.attempt)

        # only a replicated backend (DDP) can heal: other engines (deepspeed's needs the
        # model in every state_dict call) never see the partial calls of the tracker
        replicated = getattr(getattr(workload, "_backend", None), "replicated_state", False)
        return cls(saver, engine, int(ck.get("every_steps", 0)), on_saved, on_loaded,
                   _heal_of(workload, engine), track_live=bool(replicated))

    def save(self, step: int, **objects: Any) -> float:
        """Save ``objects`` as ``step``; returns the blocking time in s."""
        t0 = time.perf_counter()
        if self.track_live:
            self.live.note(step, objects, self.engine)
        self.saver.save(step, self.engine.state_dict(objects))
        self.last_save_s = time.perf_counter() - t0
        self.last_step = step
        attempt_log.saved(step, attempt_log.saver_source(self.saver), self.last_save_s)
        if self._on_saved is not None:
            self._on_saved(step, self.last_save_s)
        return self.last_save_s

    def maybe_save(self, step: int, **objects: Any) -> bool:
        """Save when ``every_steps`` divides ``step``; True when it saved. Either way
        ``objects`` are noted as the live state of ``step`` (:meth:`live_state`)."""
        if self.every_steps and step > 0 and step % self.every_steps == 0:
            self.save(step, **objects)
            return True
        if self.track_live:
            self.live.note(step, objects, self.engine)
        return False

    def live_state(self) -> Any:
        """The state noted by the newest :meth:`save` / :meth:`maybe_save` as a
        :class:`~dlrover_core.checkpoint.heal.LiveState`, or ``None`` (nothing noted,
        or the parameters moved on since)."""
        return self.live.capture(self.engine)

    def load(self, step: int | None = None, **objects: Any) -> int | None:
        """Load the newest committed step (or ``step``) into ``objects`` in place.

        Returns the loaded step, or ``None`` when no checkpoint exists (objects untouched).
        A replicated rank set up again after a failure first heals from a survivor's
        live state (the ``heal`` of the constructor; a collective: every rank of the
        role calls ``load()`` in its ``setup()``), which needs no checkpoint.
        Raises:
            CheckpointLoadError: checkpoints exist but none could be loaded (the
                built-in savers; the objects may be partly overwritten: do not train on).
        """
        heal, self._heal = self._heal, None
        healed = heal(objects) if heal is not None and step is None else None
        if healed is not None:
            self.last_step = healed
            attempt_log.restored(healed, "peer")
            if self.saver is not None:
                try:  # what the saver's own load lays out for the first saves (flash: buffers)
                    self.saver.reserve_for(self.engine.state_dict(objects))
                except Exception as exc:  # noqa: BLE001 - the first save lays them out then
                    log.warning("could not prepare the saver for saves after the heal: %s", exc)
            if self._on_loaded is not None:
                self._on_loaded(healed, "peer", "")
            return healed
        template = self.engine.state_dict(objects)
        loaded = self.saver.load(template, step)
        attempt_log.restored(loaded, attempt_log.saver_source(self.saver))
        if loaded is None:
            return None
        self.engine.load_state_dict(objects, template)
        self.last_step = loaded
        if self._on_loaded is not None:
            self._on_loaded(loaded, getattr(self.saver, "last_load_source", None),
                            os.path.join(self.saver.config.dir, step_dir_name(loaded)))
        return loaded

    def wait(self) -> None:
        self.saver.wait()

    def drain(self) -> None:
        """:meth:`Saver.drain`: the host calls it when ``run()`` returns."""
        self.saver.drain()

    def close(self, for_resetup: bool = False) -> None:
        """Close the saver; ``for_resetup``: this process sets the role instance up
        again in place next (:meth:`Saver.close_for_resetup`, where the saver has it)."""
        resetup = getattr(self.saver, "close_for_resetup", None) if for_resetup else None
        if callable(resetup):
            resetup()
        else:
            self.saver.close()


def _heal_of(workload: Any, engine: StateDictEngineBase) -> Any:
    """The ``heal`` of a worker's :class:`Checkpointer`: when the master asked for a heal
    at this setup (``workload._heal``: ``(asked, live state or None)``, set by the
    ``WorkloadHost``), the backend session's ``replicated_state`` is true and a process
    group of more than one rank is up, a function of ``objects`` running
    :func:`dlrover_core.checkpoint.heal.heal` (returns the step, or ``None``); else
    ``None``."""
    asked, live = getattr(workload, "_heal", (False, None))
    session = getattr(workload, "_backend", None)
    if not asked or not getattr(session, "replicated_state", False):
        return None
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    device = session.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def run(objects: dict) -> int | None:
        from dlrover_core.checkpoint.heal import heal

        out = heal(live, engine, objects, device)
        return None if out is None else out[0]

    return run
