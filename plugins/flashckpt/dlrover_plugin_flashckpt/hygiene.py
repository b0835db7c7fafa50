"""Shared-memory hygiene: which flash buffers are stale, and removing them.

A buffer's identity block names its job, Ray session and run (the JobMaster actor id,
empty for buffers written outside a job). A buffer is **stale** when

- it belongs to this Ray session and a run: that job's JobMaster (with that actor id)
  is gone;
- it belongs to this session without a run, or to another Ray session (another
  cluster on the same machine): both its last writer and its node's persister
  process are gone;
- it is a temp file whose creating process is gone, or it has no valid header.

Stale buffers are removed when a node's persister starts (the next job start on that
node), and by ``dlrover flash clean``. A job's own buffers are removed at its end
(``dlrover_job_finished``, which ``dlrover stop`` also triggers).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from dlrover_plugin_flashckpt import shm

log = logging.getLogger(__name__)


def master_run_id(job: str) -> str | None:
    """Actor id (hex) of the live JobMaster of ``job`` in the connected Ray cluster, or
    ``None`` when there is none (or Ray is not connected)."""
    try:
        import ray

        from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

        if not ray.is_initialized():
            return None
        handle = ray.get_actor(master_actor_name(job), namespace=MASTER_NAMESPACE)
    except Exception:  # noqa: BLE001 - no such actor
        return None
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else ""


def current_session() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_session_name() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


def stale_reason(path: str, session: str,
                 master_alive: Callable[[str, str], bool] | None = None) -> str | None:
    """Why the buffer at ``path`` is stale, or ``None`` when it may still be used.

    ``master_alive(job, run_id)`` tells whether that run's JobMaster lives (default:
    ask Ray)."""
    owner = shm.tmp_owner(path)
    if owner is not None:
        return None if shm.proc_start(owner) is not None else f"temp file of dead process {owner}"
    seg = shm.Segment.attach(path)
    if seg is None:
        return "not a valid flash buffer"
    try:
        ident = seg.ident()
        h = seg.read_header()
    finally:
        seg.close()
    if ident.get("session") == session and session and ident.get("run_id"):
        check = master_alive or (lambda job, run: master_run_id(job) == run)
        if not check(ident.get("job", ""), ident["run_id"]):
            return f"job {ident.get('job')!r} (run {ident['run_id'][:12]}) has ended"
        return None
    if shm.alive(h.writer_pid, h.writer_start) or shm.alive(h.persister_pid, h.persister_start):
        return None
    where = "this Ray session" if ident.get("session") == session else \
        f"Ray session {ident.get('session') or '?'}"
    return (f"job {ident.get('job')!r} of {where}: its trainer (pid {h.writer_pid}) and "
            f"persister (pid {h.persister_pid}) are gone")


def remove_stale(shm_dir: str, session: str,
                 master_alive: Callable[[str, str], bool] | None = None,
                 prefix: str = shm.NAME_PREFIX) -> list[str]:
    """Remove stale flash buffers (names starting with ``prefix``) in ``shm_dir``;
    return the removed names (logged)."""
    removed = []
    for path in shm.list_segments(shm_dir, prefix):
        reason = stale_reason(path, session, master_alive)
        if reason is None:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(os.path.basename(path))
        log.warning("removed stale flash-checkpoint buffer %s: %s", os.path.basename(path), reason)
    return removed


def remove_job(shm_dir: str, job: str, run_id: str | None = None,
               session: str | None = None) -> list[str]:
    """Remove the buffers of ``job`` in ``shm_dir`` (only those of ``run_id`` and
    ``session`` when given); return their names."""
    removed = []
    for path in shm.list_segments(shm_dir, shm.job_prefix(job)):
        if shm.tmp_owner(path) is None:
            seg = shm.Segment.attach(path)
            if seg is not None:
                ident = seg.ident()
                seg.close()
                if ident.get("job") != job:
                    continue
                if run_id is not None and ident.get("run_id", "") != run_id:
                    continue
                if session is not None and ident.get("session", "") != session:
                    continue
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def describe(shm_dir: str) -> list[dict]:
    """One row per flash buffer in ``shm_dir``: name, job, role, rank, state, step, bytes."""
    rows = []
    for path in shm.list_segments(shm_dir):
        seg = shm.Segment.attach(path)
        if seg is None:
            rows.append({"name": os.path.basename(path), "state": "invalid"})
            continue
        try:
            ident, h = seg.ident(), seg.read_header()
        finally:
            seg.close()
        rows.append({"name": os.path.basename(path), "job": ident.get("job"),
                     "role": ident.get("role"), "rank": h.rank, "step": h.step,
                     "state": shm.STATE_NAMES.get(shm.effective_state(h), "?"),
                     "bytes": os.path.getsize(path), "session": ident.get("session"),
                     "run_id": ident.get("run_id")})
    return rows
