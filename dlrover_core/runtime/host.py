"""The Ray actor that hosts one role instance's workload (or the driver).

The JobMaster creates one ``WorkloadHost`` per role rank. The workload class is
imported inside the worker, so an ImportError in user code is a failure of that
instance (classified ``fatal``), never of the master. User-facing calls run in the
default concurrency group (one at a time, in order); liveness calls run in the
``monitor`` group beside them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import ray

from dlrover_core.runtime import attempt_log
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.errors import WorkloadError


def _qualname(exc: BaseException) -> str:
    t = type(exc)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _resolve_refs(value: Any) -> Any:
    """Fetch the data behind ``DRef`` arguments here, worker-to-worker."""
    from dlrover_core.runtime.dref import DRef

    if isinstance(value, DRef):
        return value._fetch_local()
    return value


def _master_handle(job: str) -> Any:
    """The JobMaster actor of ``job``, or ``None`` outside a job (``testing.spawn_role``)."""
    from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

    try:
        return ray.get_actor(master_actor_name(job), namespace=MASTER_NAMESPACE)
    except ValueError:
        return None


class _HostBase:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._phase = "init"
        self._run_done = threading.Event()
        self._run_done.set()  # nothing running yet
        self._run_outcome: tuple[bool, Any] = (True, None)
        # what user code runs now: (``"run"`` or the called method, unix s, thread id)
        self._busy: tuple[str, float, int] | None = None
        #: a promoted GPU-less standby's GPU ids (its lease on the failed rank's GPU)
        self._gpu_ids: list[str] | None = None
        self._lease: Any = None  # its ResourceLease actor

    def device_assignment(self) -> dict:
        """``{"gpu_ids", "visible_devices", "cuda_device"}`` of this process
        (:func:`dlrover_core.runtime.devices.current_assignment`; no CUDA needed)."""
        from dlrover_core.runtime.devices import current_assignment

        return current_assignment(self._gpu_ids).as_dict()

    def _raise(self, exc: BaseException, role: str, rank: int, step: int) -> None:
        raise WorkloadError(role, rank, self._phase, _qualname(exc), str(exc),
                            "".join(traceback.format_exception(exc)), step) from None

    # monitor group ------------------------------------------------------------
    @ray.method(concurrency_group="monitor")
    def node_info(self) -> dict:
        """``node_id``, ``ip``, ``hostname``, ``pid``, ``placement_group_id`` (hex or
        ``None``) and ``assigned_resources`` (Ray's names, e.g. ``CPU_group_0_<pg>``
        tells the bundle index) of this actor."""
        ctx = ray.get_runtime_context()
        pg = ctx.get_placement_group_id()
        try:  # Ray's per-bundle resource names (CPU_group_<bundle>_<pg>); no public API has them
            assigned = dict(ray._private.worker.global_worker.core_worker.resource_ids())
            assigned = {k: sum(a for _, a in v) for k, v in assigned.items()}
        except Exception:  # noqa: BLE001
            assigned = ctx.get_assigned_resources()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "placement_group_id": pg, "assigned_resources": assigned,
                "device": self.device_assignment()}

    @ray.method(concurrency_group="monitor")
    def ping(self) -> float:
        return time.time()

    @ray.method(concurrency_group="monitor")
    def activity(self) -> dict:
        """What the user code of this actor is doing now, for hang diagnosis:
        ``busy`` (``"run"``, the method a driver called, or ``None`` when idle),
        ``busy_s`` (s since it started), ``in_torch`` (its innermost Python frame is
        inside the ``torch`` package: waiting in a collective or in backward, i.e. on
        its peers) and ``stack`` (the formatted stack of that thread, innermost last)."""
        busy = self._busy
        if busy is None:
            return {"busy": None, "busy_s": 0.0, "in_torch": False, "stack": ""}
        what, since, tid = busy
        frame = sys._current_frames().get(tid)
        stack = traceback.format_stack(frame) if frame is not None else []
        torch = sys.modules.get("torch")
        torch_dir = os.path.dirname(torch.__file__) + os.sep if torch is not None and \
            getattr(torch, "__file__", None) else None
        in_torch = bool(frame is not None and torch_dir
                        and frame.f_code.co_filename.startswith(torch_dir))
        return {"busy": what, "busy_s": round(time.time() - since, 3), "in_torch": in_torch,
                "stack": "".join(stack[-12:])}

    @ray.method(concurrency_group="monitor")
    def abort_collectives(self) -> str:
        """Abort this process's torch.distributed process groups so that a collective
        blocked on a failed peer returns with an error now, instead of after
        ``failover.pg_timeout_s``. Runs beside the blocked call (monitor group).

        Per backend: ``nccl``: ``ProcessGroup.abort()`` (``ncclCommAbort``) on every
        group, after which the blocked collective raises; the group is then destroyed
        and formed again by the re-setup. ``gloo``: nothing is done, since gloo's abort
        does not interrupt an operation already waiting (measured with torch 2.13: an
        ``all_reduce`` stayed blocked after ``abort()`` until the peer's process ended);
        a gloo collective fails within milliseconds once the master kills the failed
        peer ("Connection closed by peer"). Returns what was done, for the recovery's
        ``phases``: ``"none"`` (no group), ``"aborted (nccl)"`` or ``"skipped (gloo)"``.

        A script role (:mod:`dlrover_core.runtime.script`) has no group in this process:
        its child process is stopped instead, as torchrun's agent stops every worker
        of the group when one fails (``"script stopped (SIGTERM)"`` ...).
        """
        stop_script = getattr(getattr(self, "workload", None), "stop_script", None)
        if callable(stop_script):
            return stop_script()
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return "none"
        backend = str(dist.get_backend())
        if "nccl" not in backend:
            return f"skipped ({backend})"
        dist.distributed_c10d._abort_process_group()
        return "aborted (nccl)"

    def _run_guarded(self, fn: Any, role: str, rank: int, step_of: Any) -> Any:
        """Run ``fn`` as *the* run of this instance, remembering its outcome for
        :meth:`wait_run` (a restarted master re-attaches through it)."""
        self._run_done.clear()
        self._busy = ("run", time.time(), threading.get_ident())
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001
            attempt_log.ended(step_of(), exc)
            self._busy = None
            try:
                self._raise(exc, role, rank, step_of())
            except WorkloadError as werr:
                self._run_outcome = (False, werr)
                self._run_done.set()
                raise
        attempt_log.ended(step_of())
        self._busy = None
        self._run_outcome = (True, result)
        self._run_done.set()
        return result

    @ray.method(concurrency_group="monitor")
    def wait_run(self, timeout: float | None = None) -> dict:
        """Block until the current run ends (at once when none runs); returns
        ``{"done": bool, "ok": bool, "result"|"error": ...}``."""
        done = self._run_done.wait(timeout)
        ok, value = self._run_outcome
        out = {"done": done, "ok": ok}
        out["result" if ok else "error"] = value
        return out

    @ray.method(concurrency_group="monitor")
    def wait_stopped(self) -> str:
        """Blocks until the instance is told to stop; the master keeps one pending
        call per instance, so the death of the actor is seen at once."""
        self._stop.wait()
        return "stopped"


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


class WorkloadHost(_HostBase):
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

    def _plugin_manager(self) -> Any:
        if self.plugins is None:  # this worker process's own manager
            from dlrover_core.plugins.manager import get_plugin_manager

            self.plugins = get_plugin_manager()
        return self.plugins

    def prepare(self) -> float:
        """Standby only: import the workload class and run its ``warm_up()`` so that a
        promoted standby skips the imports and first-use costs. Returns seconds."""
        from dlrover_core.plugins.records import resolve
        from dlrover_core.runtime.workload import unwrap_actor_class

        t0 = time.perf_counter()
        cls = unwrap_actor_class(resolve(self.workload_path))
        warm = getattr(cls, "warm_up", None)
        if callable(warm):
            warm()
        return time.perf_counter() - t0

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

    def free_port(self) -> int:
        """A free TCP port on this node (for the role's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, attempt: int = 0,
              local_rank: int | None = None, local_world_size: int | None = None,
              node_rank: int | None = None) -> dict:
        """Import the workload, join the process group, run ``setup()``.

        Returns ``{"invocations": {method: InvocationOptions}}`` for the driver.
        Raises ``WorkloadError`` (phase ``setup``) when user code raises.
        """
        from dlrover_core.plugins.records import resolve
        from dlrover_core.runtime.invocation import collect_invocations
        from dlrover_core.runtime.workload import create_workload

        ctx = self.context
        if self.workload is not None:  # re-setup in place after a peer failed
            self._teardown_workload()
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
                                            lambda: _master_handle(ctx.job))
            pm = self._plugin_manager()
            self.workload._plugins = pm
            t.append(time.perf_counter())
            if ctx.backend:
                backend = pm.backends.get(ctx.backend)
                self.workload._backend = resolve(backend.session)(ctx)
                self.workload._backend.setup()
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
        args = tuple(_resolve_refs(a) for a in args)
        kwargs = {k: _resolve_refs(v) for k, v in kwargs.items()}
        self._busy = (str(method), time.time(), threading.get_ident())
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            self._raise(exc, self.context.role, self.context.rank,
                        self.workload._last_step if self.workload else -1)
        finally:
            self._busy = None

    @ray.method(concurrency_group="monitor")
    def shutdown(self) -> None:
        """Tear down the workload and the process group (best effort)."""
        self._stop.set()
        self._teardown_workload()

    def _teardown_workload(self) -> None:
        w = self.workload
        if w is None:
            return
        reporter = getattr(w, "_reporter", None)
        for fn in ((reporter.close if reporter is not None else None), w.teardown,
                   (w._checkpointer.close if w._checkpointer else None),
                   (w._backend.teardown if w._backend else None)):
            if fn is None:
                continue
            try:
                fn()
            except Exception:  # noqa: BLE001
                traceback.print_exc()


class DriverHost(_HostBase):
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
                       getattr(self.context, "attempt", 0))
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
