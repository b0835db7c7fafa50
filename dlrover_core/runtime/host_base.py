"""The part of the role-instance actors that does not depend on what they host: the
``monitor`` concurrency group (node info, ping, what user code is doing now, aborting
collectives, waiting for the run or the stop) and the guarded run of user code that
turns its exception into a :class:`~dlrover_core.runtime.errors.WorkloadError`.
:class:`~dlrover_core.runtime.host.WorkloadHost` and
:class:`~dlrover_core.runtime.host.DriverHost` build on it.
"""

from __future__ import annotations

import collections

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import ray

from dlrover_core.runtime import attempt_log
from dlrover_core.runtime.errors import WorkloadError

#: Longest wait (s) at the end of a run for the master to take the last step report (a
#: master that is restarting then asks for ``progress()`` instead).
REPORT_DRAIN_S = 5.0


def _qualname(exc: BaseException) -> str:
    t = type(exc)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def resolve_refs(value: Any) -> Any:
    """Fetch the data behind ``DRef`` arguments here, worker-to-worker."""
    from dlrover_core.runtime.dref import DRef

    if isinstance(value, DRef):
        return value._fetch_local()
    return value


def master_handle(job: str) -> Any:
    """The JobMaster actor of ``job``, or ``None`` outside a job (``testing.spawn_role``)."""
    from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

    try:
        return ray.get_actor(master_actor_name(job), namespace=MASTER_NAMESPACE)
    except ValueError:
        return None


class HostBase:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._phase = "init"
        self._run_done = threading.Event()
        self._run_done.set()  # nothing running yet
        self._run_outcome: tuple[bool, Any] = (True, None)
        # what user code runs now: (``"run"`` or the called method, unix s, thread id)
        self._busy: tuple[str, float, int] | None = None
        #: method -> durations (s) of its last 64 calls by a driver (activity's ``recent``)
        self._call_durations: dict[str, collections.deque] = {}
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

    def _identity(self) -> dict:
        """This actor as its node's step-report agent names it to a restarted master
        (:meth:`dlrover_core.runtime.node_reporter.NodeReporter.push`)."""
        ctx = ray.get_runtime_context()
        return {"info": self.node_info(), "actor_name": ctx.get_actor_name(),
                "handle": ctx.current_actor}

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
            return {"busy": None, "busy_s": 0.0, "in_torch": False, "stack": "", "recent": None}
        what, since, tid = busy
        frame = sys._current_frames().get(tid)
        stack = traceback.format_stack(frame) if frame is not None else []
        torch = sys.modules.get("torch")
        torch_dir = os.path.dirname(torch.__file__) + os.sep if torch is not None and \
            getattr(torch, "__file__", None) else None
        in_torch = bool(frame is not None and torch_dir
                        and frame.f_code.co_filename.startswith(torch_dir))
        return {"busy": what, "busy_s": round(time.time() - since, 3), "in_torch": in_torch,
                "stack": "".join(stack[-12:]), "recent": self.recent_durations(what)}

    def _call_done(self, method: str, seconds: float) -> None:
        self._call_durations.setdefault(method, collections.deque(maxlen=64)).append(seconds)

    def recent_durations(self, method: str) -> dict | None:
        """``{"calls", "p99_s"}`` of the last (up to 64) finished calls of ``method``
        (``None``: none yet): the master's default hang bound for driver calls."""
        d = self._call_durations.get(method)
        if not d:
            return None
        xs = sorted(d)
        return {"calls": len(xs), "p99_s": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}

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
        peer ("Connection closed by peer"). With either, a rank still computing stops
        at its next module call or DDP gradient bucket instead of at its next
        collective (:func:`dlrover_core.runtime.attempt_stop.stop`). Returns what was
        done, for the recovery's ``phases``: ``"none"`` (no group), ``"aborted (nccl)"``
        or ``"skipped (gloo)"``.

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
        from dlrover_core.runtime import attempt_stop

        attempt_stop.stop("a peer of this rank failed")
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
            self._saves_committed()
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
        self._reports_delivered()
        self._busy = None
        self._run_outcome = (True, result)
        self._run_done.set()
        return result

    def _last_report(self) -> Any:
        """The ObjectRef of this instance's newest ``master.report`` call, or ``None``."""
        return None

    def _saves_committed(self) -> None:
        """Before a run counts as done: checkpoints still being committed by a thread of
        this process (``Saver.drain``) are committed, so the last step is never dropped
        when the actor is stopped; a failed one fails the run."""

    def _reports_delivered(self, timeout_s: float = REPORT_DRAIN_S) -> None:
        """Wait (at most ``timeout_s``) until the master has taken the newest step report.

        Reports are fire-and-forget calls in the master's ``report`` concurrency group,
        and the end of a run reaches the master on another path: without this wait the
        master could write the summary before the last step's metrics arrived."""
        try:
            ref = self._last_report()
            if isinstance(ref, ray.ObjectRef):
                ray.wait([ref], timeout=timeout_s, fetch_local=False)
        except Exception:  # noqa: BLE001 - the run succeeded; a lost report is not its error
            traceback.print_exc()

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
