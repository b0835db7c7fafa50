"""The Ray actor that hosts one role instance's workload (or the driver).

The JobMaster creates one ``WorkloadHost`` per role rank. The workload class is
imported inside the worker, so an ImportError in user code is a failure of that
instance (classified ``fatal``), never of the master. User-facing calls run in the
default concurrency group (one at a time, in order); liveness calls run in the
``monitor`` group beside them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

import ray

from dlrover_core.ports import free_port
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.host_base import HostBase, master_handle, resolve_refs
from dlrover_core.runtime.warming import (
    freeze_heap,
    in_own_thread,
    low_priority,
    restore_priority,
)


#: s a promoted GPU-less standby waits for its :class:`ResourceLease` to be scheduled
LEASE_WAIT_S = 30.0


@ray.remote(num_cpus=0)
class ResourceLease:
    """Holds a bundle's resources for the process that created it (and dies with it,
    as an owned actor): a promoted GPU-less standby's reservation of the failed rank's
    CPU and GPU. Runs no user code."""

    def gpu_ids(self) -> list[str]:
        """The GPU ids Ray reserved for this lease (strings)."""
        return [str(i) for i in ray.get_gpu_ids()]


class WorkloadHost(HostBase):
    """Hosts one role instance's workload.

    Args:
        workload_path: ``package.module:Class`` of the workload.
        context: the instance's ``WorkerContext``.
        plugin_manager: the plugins of this process; default: the process-wide
            manager, looked up once when the workload is set up. It is handed to the
            workload (``workload._plugins``) for its backend session, hooks and
            checkpointer.
    """

    def __init__(self, workload_path: str, context: WorkerContext,
                 plugin_manager: Any = None) -> None:
        super().__init__()
        os.environ.update(context.env())
        self.context = context
        self.workload_path = workload_path
        if context.job_dir:  # hang diagnosis: stacks on a signal (runtime.stack_dump)
            from dlrover_core.runtime.stack_dump import register

            register(context.job_dir)
        self.workload: Any = None
        self.plugins = plugin_manager
        #: whether :func:`freeze_heap` ran in this process (once: by ``prepare()`` or
        #: the first ``setup()``, never over what a workload's setup made)
        self._heap_frozen = False

    def _plugin_manager(self) -> Any:
        if self.plugins is None:  # this worker process's own manager
            from dlrover_core.plugins.manager import get_plugin_manager

            self.plugins = get_plugin_manager()
        return self.plugins

    def _backend_session(self) -> Any:
        """A new session of the role's backend (``context.backend``, from the plugins)."""
        from dlrover_core.plugins.records import resolve

        backend = self._plugin_manager().backends.get(self.context.backend)
        return resolve(backend.session)(self.context)

    def prepare(self, idle: bool = True) -> float:
        """Standby only: import the workload class, run the role's backend session's
        ``warm_up()`` (e.g. FSDP2's first wrap and step in a fake group; in a thread of
        its own: :func:`in_own_thread`) and the workload's ``warm_up()``, then import
        the job's checkpoint saver and engine and look up the JobMaster
        (:meth:`_warm_job_lookups`), so that a promoted standby skips the imports and
        first-use costs, and run the saver's ``prepare_standby`` (:meth:`_prepare_saver`);
        last, collect and freeze the heap (:func:`freeze_heap`). With ``idle`` (a spare
        that replaces a promoted one), all of it at the lowest CPU priority
        (:func:`low_priority`, for 30 s at most) unless :meth:`hurry` came first or
        comes meanwhile. A backend warm-up, a look-up or a saver preparation
        that raises is reported on stderr and skipped (the spare stays usable); the
        workload's warm-up raises. Returns seconds."""
        from dlrover_core.plugins.records import resolve
        from dlrover_core.runtime.workload import unwrap_actor_class

        t0 = time.perf_counter()
        with low_priority() if idle else contextlib.nullcontext():
            cls = unwrap_actor_class(resolve(self.workload_path))
            if self.context.backend:
                try:
                    in_own_thread(self._backend_session().warm_up)
                except Exception:  # noqa: BLE001 - a warm-up only saves time; say why it did not
                    sys.stderr.write(f"dlrover: backend {self.context.backend!r} warm-up "
                                     f"failed, skipped:\n{traceback.format_exc()}")
            warm = getattr(cls, "warm_up", None)
            if callable(warm):
                warm()
            try:
                self._warm_job_lookups()
            except Exception:  # noqa: BLE001 - a warm-up only saves time; say why it did not
                sys.stderr.write(f"dlrover: checkpoint/master look-ups ahead failed, skipped:\n"
                                 f"{traceback.format_exc()}")
            try:
                self._prepare_saver()
            except Exception:  # noqa: BLE001 - a warm-up only saves time; say why it did not
                sys.stderr.write(f"dlrover: the saver's standby preparation failed, skipped:\n"
                                 f"{traceback.format_exc()}")
            if not self._heap_frozen:
                freeze_heap(collect=True)
                self._heap_frozen = True
        return time.perf_counter() - t0

    def _warm_job_lookups(self) -> None:
        """Standby only: import the job's checkpoint saver and the backend's state-dict
        engine (the plugin modules a promoted spare's first checkpoint load imports)
        and look up the JobMaster (``ray.get_actor`` loads the actor's class from the
        GCS the first time in a process): together about 0.2 s of a promoted rank's
        ``setup()`` on 2 cores, measured with ``cProfile``."""
        from dlrover_core.checkpoint.checkpointer import checkpoint_classes

        checkpoint_classes(self.context, self._plugin_manager())
        master_handle(self.context.job)

    def _prepare_saver(self) -> None:
        """Standby only: the job's saver's :meth:`~dlrover_core.checkpoint.saver.Saver.
        prepare_standby` (the flash saver maps this node's buffers of the role, so that
        a promoted spare's first load copies from memory)."""
        from dlrover_core.checkpoint.checkpointer import (
            checkpoint_classes,
            saver_config,
            saver_context,
        )

        if not self.context.checkpoint:
            return
        saver_cls, _ = checkpoint_classes(self.context, self._plugin_manager())
        prepare = getattr(saver_cls, "prepare_standby", None)   # a Saver's: may be absent
        if callable(prepare):
            prepare(saver_config(self.context), saver_context(self.context))

    @ray.method(concurrency_group="monitor")
    def hurry(self) -> float:
        """Standby only: a promotion is waiting for :meth:`prepare`; it finishes at full
        CPU priority (:func:`restore_priority`). Answers as ``ping`` (a time, s)."""
        restore_priority()
        return time.time()

    @ray.method(concurrency_group="monitor")
    def progress(self) -> dict:
        """The last step this instance reported and its metrics (for a restarted master)."""
        w = self.workload
        if w is None:
            return {"step": -1, "metrics": {}}
        return {"step": w._last_step, "metrics": dict(w._last_metrics)}

    def assign(self, context: WorkerContext, lease: dict | None = None) -> None:
        """Standby only: become the role instance described by ``context``.

        ``lease`` (a GPU-less spare): ``{"placement_group", "bundle_index",
        "resources"}`` of the failed rank's bundle (resources in Ray's names: ``CPU``,
        ``GPU``, ``memory``); a :class:`ResourceLease` owned by this process holds them,
        and this instance computes on the GPU Ray gave the lease.

        Raises:
            GetTimeoutError: the lease was not scheduled within
                :data:`LEASE_WAIT_S` (the bundle is still held).
        """
        if lease is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            res = lease["resources"]
            opts: dict[str, Any] = {
                "num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=lease["placement_group"],
                    placement_group_bundle_index=lease["bundle_index"])}
            if res.get("memory"):
                opts["memory"] = res["memory"]
            self._lease = ResourceLease.options(**opts).remote()
            self._gpu_ids = ray.get(self._lease.gpu_ids.remote(), timeout=LEASE_WAIT_S)
        self.context = context
        os.environ.update(context.env())

    def rendezvous_port(self) -> int:
        """Rank 0 only, before the role's ``setup()`` calls: the TCP port of the
        role's rendezvous on this node, made ready by its backend
        (:meth:`~dlrover_core.runtime.backend.BackendSession.open_rendezvous`: a
        torch.distributed backend opens its store server there, so that no rank
        waits for it); a free port when the role has no backend."""
        if not self.context.backend:
            return free_port(host="")
        return self._backend_session().open_rendezvous()

    def setup(self, master_addr: str, master_port: int, attempt: int = 0,
              local_rank: int | None = None, local_world_size: int | None = None,
              node_rank: int | None = None, heal: bool = False) -> dict:
        """Import the workload, join the process group, freeze the heap (the first time
        in this process: :func:`freeze_heap`), run ``setup()``.
        ``heal``: survivors are set up in place; a survivor keeps its live state for
        the first ``load()``, which heals a replicated role (``checkpoint.heal``).

        Returns ``{"invocations": {method: InvocationOptions}}`` for the driver.
        Raises ``WorkloadError`` (phase ``setup``) when user code raises.
        """
        from dlrover_core.checkpoint.heal import live_state_of
        from dlrover_core.plugins.records import resolve
        from dlrover_core.runtime import attempt_stop
        from dlrover_core.runtime.invocation import collect_invocations
        from dlrover_core.runtime.workload import create_workload

        ctx = self.context
        attempt_stop.clear()   # (a stop armed for the attempt a peer's failure ended)
        live = live_state_of(self.workload) if heal else None
        if self.workload is not None:  # re-setup in place after a peer failed
            self._teardown_workload(resetup=True)
            self.workload = None
        ctx.master_addr, ctx.master_port, ctx.attempt = master_addr, master_port, attempt
        if local_rank is not None:
            ctx.local_rank, ctx.local_world_size, ctx.node_rank = (local_rank, local_world_size,
                                                                   node_rank)
        device = self.device_assignment()
        ctx.gpu_ids, ctx.cuda_device = device["gpu_ids"], device["cuda_device"]
        os.environ.update(ctx.env())
        self._phase = "setup"
        t = [time.perf_counter()]
        try:
            self.workload = create_workload(resolve(self.workload_path), ctx,
                                            lambda: master_handle(ctx.job))
            pm = self._plugin_manager()
            self.workload._plugins = pm
            self.workload._heal = (heal, live)
            self.workload._identity = self._identity
            t.append(time.perf_counter())
            if ctx.backend:
                self.workload._backend = self._backend_session()
                self.workload._backend.setup()
            if not self._heap_frozen:  # the imports are done; the workload makes nothing yet
                freeze_heap()
                self._heap_frozen = True
            t.append(time.perf_counter())
            pm.workload_setup(self.workload)
            self.workload.setup()
            pm.workload_started(self.workload)
            t.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported to the master, classified there
            self._raise(exc, ctx.role, ctx.rank, -1)
        self._phase = "run"
        timings = {"import_s": t[1] - t[0], "process_group_s": t[2] - t[1],
                   "user_setup_s": t[3] - t[2]}
        return {"invocations": collect_invocations(type(self.workload)), "device": device,
                "timings": {k: round(v, 3) for k, v in timings.items()}}

    def run(self) -> Any:
        """The workload's ``run()`` (SPMD roles without a driver)."""
        w = self.workload
        return self._run_guarded(w.run, self.context.role, self.context.rank,
                                 lambda: w._last_step)

    def _saves_committed(self) -> None:
        checkpointer = getattr(self.workload, "_checkpointer", None)
        if checkpointer is not None:
            checkpointer.drain()

    def _last_report(self) -> Any:
        reporter = getattr(self.workload, "_reporter", None)
        if reporter is None:
            return None
        reporter.flush()  # a coalescing rank's newest step goes now, not an interval later
        return reporter.last_sent

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``workload.<method>(*args, **kwargs)``; ``DRef`` arguments are fetched here.

        Only public methods of the workload are callable (no ``_private`` names, no
        dunders, no properties or data attributes, not ``setup``/``teardown``/
        ``warm_up``): anything else raises ``WorkloadError`` with ``exc_type``
        ``AttributeError`` naming the method and listing the allowed ones.
        """
        from dlrover_core.runtime.invocation import resolve_remote_method

        try:
            if self.workload is None:
                raise RuntimeError(f"{method!s} called before setup(): the workload of "
                                   f"{self.context.role}-{self.context.rank} does not exist yet")
            fn = resolve_remote_method(self.workload, method)
        except (AttributeError, RuntimeError) as exc:
            self._raise(exc, self.context.role, self.context.rank, -1)
        args = tuple(resolve_refs(a) for a in args)
        kwargs = {k: resolve_refs(v) for k, v in kwargs.items()}
        self._busy = (str(method), time.time(), threading.get_ident())
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            self._raise(exc, self.context.role, self.context.rank,
                        self.workload._last_step if self.workload else -1)
        finally:
            self._call_done(str(method), time.time() - self._busy[1])
            self._busy = None

    @ray.method(concurrency_group="monitor")
    def shutdown(self) -> None:
        """Tear down the workload and the process group (best effort)."""
        self._stop.set()
        self._teardown_workload()

    def _teardown_workload(self, resetup: bool = False) -> None:
        """Tear the workload down: its reporter, ``teardown()``, its checkpointer (for a
        re-setup in place, ``resetup``: the saver may hand its mappings to the next
        one), its backend session. Errors are printed, not raised."""
        w = self.workload
        if w is None:
            return
        reporter = getattr(w, "_reporter", None)
        ck = w._checkpointer
        for fn in ((reporter.close if reporter is not None else None), w.teardown,
                   ((lambda: ck.close(for_resetup=resetup)) if ck else None),
                   (w._backend.teardown if w._backend else None)):
            if fn is None:
                continue
            try:
                fn()
            except Exception:  # noqa: BLE001
                traceback.print_exc()


class DriverHost(HostBase):
    """Hosts the ``BaseTrainer`` of an MPMD job."""

    def __init__(self, driver_path: str, context: Any) -> None:
        super().__init__()
        self.context = context
        self.driver_path = driver_path
        self.trainer: Any = None

    def setup(self) -> None:
        from dlrover_core.plugins.records import resolve
        from dlrover_core.runtime.log_capture import capture_output
        from dlrover_core.runtime.trainer import create_trainer

        # the driver's stdout/stderr into <job_dir>/logs/driver/attempt-<N>.log
        capture_output(getattr(self.context, "job_dir", ""), "driver", 0,
                       getattr(self.context, "attempt", 0),
                       getattr(self.context, "observability", None))
        self._phase = "setup"
        try:
            self.trainer = create_trainer(resolve(self.driver_path), self.context)
            self.trainer.init()
        except BaseException as exc:  # noqa: BLE001
            self._raise(exc, "driver", 0, -1)
        self._phase = "run"

    def run(self) -> Any:
        t = self.trainer
        return self._run_guarded(t.fit, "driver", 0, lambda: t._last_step)

    def _last_report(self) -> Any:
        return getattr(self.trainer, "_last_report", None)

    @ray.method(concurrency_group="monitor")
    def shutdown(self) -> None:
        self._stop.set()


_MONITOR = {"monitor": 4}


def remote_workload_host() -> Any:
    """``WorkloadHost`` as a Ray actor class with a ``monitor`` concurrency group."""
    return ray.remote(concurrency_groups=_MONITOR)(WorkloadHost)


def remote_driver_host() -> Any:
    """``DriverHost`` as a Ray actor class with a ``monitor`` concurrency group."""
    return ray.remote(concurrency_groups=_MONITOR)(DriverHost)
