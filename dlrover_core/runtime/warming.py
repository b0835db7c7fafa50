"""What a worker process does once to warm up (:mod:`dlrover_core.runtime.host`):
freeze the heap the imports made, run a backend's warm-up in a thread of its own, and
warm a standby at the lowest CPU priority (:func:`low_priority`)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

#: bit of ``CAP_SYS_NICE`` in ``/proc/self/status``'s ``CapEff`` (linux/capability.h)
_CAP_SYS_NICE = 23
#: the scheduling policies :func:`low_priority` moves threads from (not real-time ones)
_FAIR = (os.SCHED_OTHER, os.SCHED_BATCH) if hasattr(os, "SCHED_IDLE") else ()

#: s at most that :func:`low_priority` keeps a process at idle priority: then it raises
#: it back (:func:`restore_priority`), so that a node kept busy by other work cannot
#: keep a standby cold for good (in a 2-core job a spare warmed in 16-19 s)
IDLE_MAX_S = 30.0

_priority_lock = threading.Lock()
#: what :func:`low_priority` lowered: ``(the lowering thread's policy, {thread id: its
#: policy before})``; ``None``: nothing lowered now
_lowered_from: tuple[int, dict[int, int]] | None = None
#: :func:`restore_priority` was called: a later :func:`low_priority` lowers nothing
_hurried = False


def freeze_heap(collect: bool = False) -> int:
    """Move every object Python's cyclic garbage collector tracks now into its
    permanent generation (``gc.freeze``), so that no later collection scans them.

    Called once per worker process, when it has imported the workload, torch and Ray
    and before the workload's ``setup()`` makes anything: in a worker of the nanogpt
    job those imports leave 225,000-360,000 tracked objects, and every full (oldest
    generation) collection scanned all of them, 0.10-0.23 s each on 2 cores (timed
    with ``gc.callbacks``): one or two in each rank's ``setup()``, on a recovery's
    path, and about one every 8 s of training, stalling the step of that rank and,
    at the next collective, of every rank. Objects made later (the model, the
    optimizer, what a re-setup in place drops) are collected as before. (CPython's
    documentation of ``gc.freeze`` describes it for long-lived objects of a parent
    process before ``fork``; the saving of scan time is the same.)

    Args:
        collect: run a full collection first (a standby, off the recovery's path), so
            that garbage the imports left is freed instead of kept.
    Returns:
        the number of objects in the permanent generation afterwards.
    """
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def in_own_thread(fn: Any) -> Any:
    """Run ``fn()`` in a new thread, wait for it and return its result (or raise what it
    raised).

    A backend's warm-up in a standby runs this way. torch caches DTensor sharding
    propagation per thread, keyed by the operator, the shapes and the DeviceMesh, and a
    DeviceMesh equals another of the same ranks whatever its process group and local
    rank (torch 2.13); a cached result carries the mesh it was computed on. Run in the
    thread that later runs the workload, a warm-up on a fake group (as rank 0) gave a
    promoted spare of rank 1, for every parameter of a shape the warm-up had used, the
    warm-up's mesh, whose coordinate is rank 0's: after one optimizer step, parameter
    and optimizer state said they held rank 0's shard (a 2-process gloo probe of the
    warm-up's own model; a trial warm-up of the job's model on the same path made a
    promoted rank's checkpoint load fail on the shard sizes). In a thread of its own the
    warm-up's cache entries are never looked up again; what it pays for once per
    process (imports, lazy initialisation) stays paid.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlrover-warm-up") as pool:
        return pool.submit(fn).result()


def _thread_ids() -> list[int]:
    """The ids of this process's threads (Linux: ``/proc/self/task``); ``[]`` elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _may_raise_priority(to_nice: int) -> bool:
    """Whether this process may move a thread of nice value ``to_nice`` from
    ``SCHED_IDLE`` back to ``SCHED_OTHER`` (Linux ``can_nice``: ``CAP_SYS_NICE``, or
    ``RLIMIT_NICE`` >= ``20 - to_nice``; sched(7))."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - to_nice:
        return True
    try:
        with open("/proc/self/status") as f:
            caps = next((ln.split()[1] for ln in f if ln.startswith("CapEff:")), "0")
        return bool(int(caps, 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        return False


def _per_thread(get: Any) -> dict[int, int]:
    """Thread id -> ``get(tid)``, of this process's threads (ended ones left out)."""
    out = {}
    for tid in _thread_ids():
        try:
            out[tid] = get(tid)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def _nices() -> dict[int, int]:
    """Thread id -> nice value, of this process's threads (Ray starts its workers at
    nice 15, ``RAY_worker_niceness``; a few of their threads stay at 0)."""
    return _per_thread(lambda tid: os.getpriority(os.PRIO_PROCESS, tid))


def _policies() -> dict[int, int]:
    """Thread id -> scheduling policy (``os.SCHED_*``), of this process's threads."""
    return _per_thread(os.sched_getscheduler)


def _set_policy(policy: int, before: dict[int, int] | None = None,
                skip: frozenset[int] = frozenset()) -> None:
    """Move every thread of this process but those in ``skip`` to ``policy``, or to its
    policy in ``before`` where it has one, keeping its nice value (policies are per
    thread on Linux; new threads inherit their creator's). Real-time threads and
    threads that ended meanwhile are left alone."""
    before = before or {}
    for tid, now in _policies().items():
        if now not in (*_FAIR, os.SCHED_IDLE) or tid in skip:
            continue
        try:
            os.sched_setscheduler(tid, before.get(tid, policy), os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def low_priority(max_s: float | None = IDLE_MAX_S) -> Iterator[bool]:
    """Run the body with every thread of this process under ``SCHED_IDLE`` (threads it
    starts inherit it) and give each its scheduling policy back afterwards, or after
    ``max_s`` seconds if the body runs longer (a timer thread of its own, at the normal
    priority, calls :func:`restore_priority`; ``None``: no bound). Threads started
    meanwhile get the calling thread's policy back; nice values are kept.

    ``SCHED_IDLE`` runs a thread only on CPU time no other thread wants (Linux's CFS
    weighs it 3 against 1024 at nice 0 and 36 at nice 15, where Ray starts its workers;
    sched(7)). A standby's warm-up (imports, the backend's and the workload's
    ``warm_up()``, the saver's mappings: seconds of CPU) runs this way, so that it
    takes only what the ranks sharing its cores leave idle: on the 2-core demo a
    spare warming at the ranks' priority slowed their steps from 0.34 s to about
    0.48 s for 4-5 s after every promotion (``benchmarks/goodput.py``). Where its
    bundle has cores of its own it loses nothing.

    Lowers nothing (yields ``False``) where the process could not move its threads back
    afterwards (no ``CAP_SYS_NICE`` and a ``RLIMIT_NICE`` below ``20 - nice`` of one of
    them): a promoted rank must not keep computing at the lowest priority. Nor after
    :func:`restore_priority` (a promotion that came during the warm-up), nor where
    threads have no ids or no ``SCHED_IDLE`` (not Linux).
    """
    global _lowered_from
    with _priority_lock:
        lower = False
        if _FAIR and not _hurried and _lowered_from is None:
            nices = _nices()
            lower = bool(nices) and _may_raise_priority(min(nices.values()))
        timer = None
        if lower:
            _lowered_from = (os.sched_getscheduler(0), _policies())
            if max_s is not None:
                timer = threading.Timer(max_s, restore_priority)
                timer.daemon = True
                timer.start()   # (its thread's id is known once started)
            _set_policy(os.SCHED_IDLE,
                        skip=frozenset([timer.native_id]) if timer else frozenset())
    try:
        yield lower
    finally:
        if timer is not None:
            timer.cancel()
        if lower:
            with _priority_lock:
                if _lowered_from is not None:
                    _set_policy(*_lowered_from)
                    _lowered_from = None


def restore_priority() -> bool:
    """Give every thread of this process back the policy :func:`low_priority` moved it
    from, and keep any later :func:`low_priority` from lowering it: a standby promoted
    while it still warms up finishes at full priority. Returns whether anything was
    lowered. Safe from any thread."""
    global _lowered_from, _hurried
    with _priority_lock:
        _hurried = True
        if _lowered_from is None:
            return False
        _set_policy(*_lowered_from)
        _lowered_from = None
        return True
