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
node; in the saver's ``checkpoint.options.shm_dir``, and in any other directory a rank
registers), and by ``dlrover flash clean``. A job's own buffers are removed at its end
(``dlrover_job_finished``, which ``dlrover stop`` also triggers; in the spec's
``shm_dir``), and by ``dlrover delete`` (``dlrover_job_deleted``: in the directories
every saver of the job on this machine recorded, :func:`record_shm_dir`, since the job
directory holding the spec is gone by then).

A buffer that holds a step newer than the newest step committed in its checkpoint
directory (:func:`unpersisted_step`) is never removed by the job's end nor as stale:
it may be the only copy of the final step. ``dlrover flash ls`` marks it
``not_persisted``; the next run of the job loads it from memory and its persister
writes it; ``dlrover flash clean --job NAME --force`` drops it.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from typing import Callable

from dlrover_plugin_flashckpt import shm, storage

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


def _records(job: str, create: bool = False) -> str | None:
    """``<tmp>/dlrover-flash-<uid>/<job>``: this machine's record of the shared-memory
    directories of ``job``'s buffers; ``None`` when the per-user folder is missing, or
    is not a directory owned by this user and closed to others (logged)."""
    base = os.path.join(tempfile.gettempdir(), f"dlrover-flash-{os.getuid()}")
    if create:
        os.makedirs(base, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("%s is not a private directory of this user: the flash buffers' "
                    "directories are not recorded there", base)
        return None
    return os.path.join(base, shm.safe_name(job, 100))


def record_shm_dir(job: str, shm_dir: str) -> None:
    """Record on this machine that ``job`` keeps buffers in ``shm_dir`` (one small file
    per directory; failures are logged, never raised), for :func:`recorded_shm_dirs`."""
    try:
        d = _records(job, create=True)
        if d is None:
            return
        path = os.path.join(d, shm.dir_key(shm_dir))
        if not os.path.exists(path):
            os.makedirs(d, mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(os.path.abspath(shm_dir))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record the shared-memory directory of job %r: %s", job, exc)


def recorded_shm_dirs(job: str) -> list[str]:
    """The shared-memory directories :func:`record_shm_dir` recorded for ``job`` on
    this machine, sorted (``[]``: none)."""
    d = _records(job)
    out = set()
    for name in os.listdir(d) if d and os.path.isdir(d) else []:
        if name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(d, name)) as f:
                out.add(f.read().strip())
        except OSError:
            continue
    return sorted(p for p in out if p)


def forget_shm_dirs(job: str) -> None:
    """Drop this machine's record of ``job``'s shared-memory directories."""
    d = _records(job)
    if d:
        shutil.rmtree(d, ignore_errors=True)


def current_session() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_session_name() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


def unpersisted_step(seg: shm.Segment) -> int | None:
    """The step ``seg`` holds when it is newer than the newest committed step of the
    buffer's checkpoint directory (which exists) and the save belongs to that
    directory's current lineage (:func:`.choice.in_lineage`: a save of an abandoned
    attempt, or of a run whose folder was moved aside, can never be loaded), else
    ``None``."""
    from dlrover_plugin_flashckpt.choice import buffer_tag, in_lineage

    h = seg.read_header()
    if not shm.holds_step(h):
        return None
    directory = seg.ident().get("dir")
    if not directory or not os.path.isdir(directory):
        return None
    if not in_lineage(storage.read_lineage(directory), h.step, buffer_tag(seg.meta_bytes(h))):
        return None
    newest = storage.newest_committed(directory)
    return h.step if newest is None or h.step > newest else None


def _unpersisted_at(path: str) -> int | None:
    try:
        seg = shm.Segment.attach(path)
    except shm.ShmTrustError:
        return None
    if seg is None:
        return None
    try:
        return unpersisted_step(seg)
    finally:
        seg.close()


def stale_reason(path: str, session: str,
                 master_alive: Callable[[str, str], bool] | None = None) -> str | None:
    """Why the buffer at ``path`` is stale, or ``None`` when it may still be used.

    ``master_alive(job, run_id)`` tells whether that run's JobMaster lives (default:
    ask Ray)."""
    owner = shm.tmp_owner(path)
    if owner is not None:
        return None if shm.proc_start(owner) is not None else f"temp file of dead process {owner}"
    try:
        seg = shm.Segment.attach(path)
    except shm.ShmTrustError as exc:  # not ours to judge nor to remove: reported by ls
        log.warning("%s", exc)
        return None
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
        step = _unpersisted_at(path)
        if step is not None:
            log.warning("kept flash-checkpoint buffer %s (%s): it holds step %d, newer than "
                        "the newest committed step of its directory", os.path.basename(path),
                        reason, step)
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(os.path.basename(path))
        log.warning("removed stale flash-checkpoint buffer %s: %s", os.path.basename(path), reason)
    return removed


def remove_job(shm_dir: str, job: str, run_id: str | None = None,
               session: str | None = None, keep_unpersisted: bool = False,
               kept: list[dict] | None = None) -> list[str]:
    """Remove the buffers of ``job`` in ``shm_dir`` (only those of ``run_id`` and
    ``session`` when given); return their names. With ``keep_unpersisted`` a buffer
    holding a step newer than its directory's newest commit stays, and is appended to
    ``kept`` (``{"name", "role", "rank", "step", "dir", "shm_dir"}``)."""
    removed = []
    for path in shm.list_segments(shm_dir, shm.job_prefix(job)):
        if shm.tmp_owner(path) is None:
            try:
                seg = shm.Segment.attach(path)
            except shm.ShmTrustError:
                continue  # not a buffer this user made: left alone
            if seg is not None:
                try:
                    ident = seg.ident()
                    step = unpersisted_step(seg) if keep_unpersisted else None
                    rank = seg.read_header().rank
                finally:
                    seg.close()
                if ident.get("job") != job:
                    continue
                if run_id is not None and ident.get("run_id", "") != run_id:
                    continue
                if session is not None and ident.get("session", "") != session:
                    continue
                if step is not None:
                    if kept is not None:
                        kept.append({"name": os.path.basename(path), "role": ident.get("role"),
                                     "rank": rank, "step": step, "dir": ident.get("dir"),
                                     "shm_dir": shm_dir})
                    continue
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def describe(shm_dir: str) -> list[dict]:
    """One row per flash buffer in ``shm_dir``: name, job, role, rank, state, step, bytes,
    session, run_id; ``not_persisted: True`` when it holds a step newer than the newest
    committed one of its directory; ``state: refused`` (with ``error``) for a file the
    saver would not map (:class:`shm.ShmTrustError`)."""
    rows = []
    for path in shm.list_segments(shm_dir):
        try:
            seg = shm.Segment.attach(path)
        except shm.ShmTrustError as exc:
            rows.append({"name": os.path.basename(path), "state": "refused",
                         "error": str(exc)})
            continue
        if seg is None:
            rows.append({"name": os.path.basename(path), "state": "invalid"})
            continue
        try:
            ident, h = seg.ident(), seg.read_header()
            unpersisted = unpersisted_step(seg)
        finally:
            seg.close()
        row = {"name": os.path.basename(path), "job": ident.get("job"),
               "role": ident.get("role"), "rank": h.rank, "step": h.step,
               "state": shm.STATE_NAMES.get(shm.effective_state(h), "?"),
               "bytes": os.path.getsize(path), "session": ident.get("session"),
               "run_id": ident.get("run_id")}
        if unpersisted is not None:
            row["not_persisted"] = True
        rows.append(row)
    return rows
