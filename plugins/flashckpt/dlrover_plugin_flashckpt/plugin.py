"""Entry point of the ``flashckpt`` plugin. Imports nothing heavy: torch is imported by
the saver in the worker process; the master-side hooks use Ray only.

- ``dlrover_checkpoint_savers``: the ``flash`` saver.
- ``dlrover_workload_failed`` (master): a trainer died or failed; persist the newest
  step every rank of its role holds in memory and that is not on disk yet
  (breakpoint save), before the recovery restarts the role.
- ``dlrover_job_finished`` (master; also after ``dlrover stop``): persist what is not
  on disk yet, stop the job's persisters and remove its shared-memory buffers, except
  those holding a step newer than the newest commit: they stay, and the summary lists
  them under ``checkpoint_not_persisted`` (role, rank, step, dir, node, name, shm_dir).
- ``dlrover_job_health`` (master, every 10 s): a persister that cannot persist (a
  full checkpoint folder), or one replaced by a new process since the poll before (it
  died), shows in ``dlrover status`` and as ``health_failing`` / ``health_recovered``
  events.
- ``dlrover_cli_commands``: ``dlrover flash ls`` and ``dlrover flash clean``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from dlrover_core import CheckpointSaver, hookimpl

log = logging.getLogger(__name__)

#: seconds the master waits at job end for the persisters to write what is left
FINISH_TIMEOUT_S = 120.0


def validate_options(options: dict) -> None:
    """``checkpoint.options`` of the flash saver, checked when the spec is loaded."""
    from dlrover_plugin_flashckpt.options import FlashOptions

    FlashOptions.parse(options)


@hookimpl
def dlrover_checkpoint_savers() -> list[CheckpointSaver]:
    return [CheckpointSaver(
        name="flash", saver="dlrover_plugin_flashckpt.saver:FlashSaver",
        validate_options=validate_options,
        description="copy to shared memory in memcpy time, persist asynchronously from a "
                    "per-node process, save at breakpoint, load from memory after a restart")]


@hookimpl
def dlrover_workload_failed(job: str, failure: Any, verdict: Any, emit: Any) -> None:
    if not failure.role or failure.role == "driver":
        return
    try:
        from dlrover_plugin_flashckpt.persister import breakpoint_save

        result = breakpoint_save(job, failure.role)
    except Exception as exc:  # noqa: BLE001 - a hook must never break the recovery
        log.warning("flash breakpoint save for %s/%s failed: %s", job, failure.role, exc)
        return
    if result["step"] is not None:
        log.warning("flash breakpoint save of %s/%s step %d: %s", job, failure.role,
                    result["step"], result["claimed"])
        emit("flash_breakpoint_save", role=failure.role, step=result["step"],
             claimed=result["claimed"])


#: job -> node id -> pid of its persister at the last health poll (master process)
_PERSISTER_PIDS: dict[str, dict[str, int]] = {}
#: Ray's key-value store keeps the pids seen for a restarted master (key: job/run)
_KV_NAMESPACE = "dlrover-flash-persister-pids"


def _run_identity() -> str:
    """This run of the job: the JobMaster's actor id (Ray restarts a killed master
    under the same id; a new submission gets a new one), the driver's job id outside an
    actor."""
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() or ctx.get_job_id() or ""


def _kv_key(job: str) -> bytes:
    return f"{job}/{_run_identity()}".encode()


def _seen_pids(job: str) -> dict[str, int]:
    """The pids seen at the last poll of this run: this process's, else (a restarted
    master's first poll) those the master before it stored in Ray's key-value store."""
    if job in _PERSISTER_PIDS:
        return _PERSISTER_PIDS[job]
    seen: dict[str, int] = {}
    try:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(_kv_key(job), namespace=_KV_NAMESPACE)
        seen = {str(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
    except Exception as exc:  # noqa: BLE001 - unreadable: start from nothing, as before
        log.warning("could not read the persister pids of %s seen before: %s", job, exc)
    return _PERSISTER_PIDS.setdefault(job, seen)


def _store_pids(job: str, seen: dict[str, int]) -> None:
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(_kv_key(job), json.dumps(seen).encode(),
                                     overwrite=True, namespace=_KV_NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - a health check must never break the job
        log.warning("could not store the persister pids of %s: %s", job, exc)


def persister_restarts(job: str, timeout: float = 5.0) -> dict[str, dict]:
    """``node_id -> {"what", "error"}`` for each node whose persister of ``job`` is
    another process than at the last call (the one before died, e.g. SIGKILLed, and a
    rank's next save started a new one); ``{}`` otherwise (also at a run's first call).
    The pids seen are kept in Ray's key-value store too, under this run's identity
    (:func:`_run_identity`), so a master restarted by Ray between the persister's death
    and its next poll still reports it (the chaos run's persister SIGKILLed 0.2 s
    before the master went unreported)."""
    import ray

    from dlrover_plugin_flashckpt.handles import persisters_of

    seen = _seen_pids(job)
    before = dict(seen)
    out = {}
    for node, handle in persisters_of(job).items():
        try:
            pid = int(ray.get(handle.status.remote(), timeout=timeout)["pid"])
        except Exception:  # noqa: BLE001 - dead or stuck: persist_failures reports it
            continue
        old, seen[node] = seen.get(node), pid
        if old is not None and old != pid:
            out[node] = {"what": "persister", "error": f"the persister process (pid {old}) "
                         f"was lost; a new one (pid {pid}) took over"}
    if seen != before:
        _store_pids(job, seen)
    return out


@hookimpl
def dlrover_job_health(job: str, spec: Any) -> dict | None:
    """``{"checkpoint_persist": {node_id: {"what", "error", "since", "tries", ...}}}``
    while a persister of the job cannot persist (a full or failing checkpoint folder;
    :func:`.handles.persist_failures`), and ``{"persister_restarted": {node_id: {"what",
    "error"}}}`` at the poll that finds a node's persister replaced since the poll
    before (:func:`persister_restarts`; the next poll reports it recovered); else
    ``None``. Master process."""
    if not shm_dirs_of(spec):  # not a flash job
        return None
    try:
        from dlrover_plugin_flashckpt.handles import persist_failures

        failing = persist_failures(job, timeout=5.0)
        restarted = persister_restarts(job)
    except Exception as exc:  # noqa: BLE001 - a health check must never break the job
        log.warning("could not ask the flash persisters of %s: %s", job, exc)
        return None
    out = {"checkpoint_persist": failing} if failing else {}
    if restarted:
        out["persister_restarted"] = restarted
    return out or None


def shm_dirs_of(spec: Any) -> list[str]:
    """The shared-memory directory the job's flash saver was configured with
    (``checkpoint.options.shm_dir``, default ``/dev/shm``), as a one-element list;
    ``[]`` when the job does not use the flash saver."""
    from dlrover_plugin_flashckpt.options import FlashOptions

    ck = (spec or {}).get("checkpoint") or {}
    if ck.get("saver") != "flash":
        return []
    return [FlashOptions.parse(dict(ck.get("options") or {})).shm_dir]


@hookimpl
def dlrover_job_deleted(job: str, job_dir: str) -> list[str]:
    """``dlrover delete``: every buffer of ``job`` on this machine, in the shared-memory
    directories its savers recorded here (``checkpoint.options.shm_dir``; the job
    directory, with the spec, is gone when this runs), or ``/dev/shm`` when none
    were recorded; then the record."""
    from dlrover_plugin_flashckpt.handles import DEFAULT_SHM_DIR
    from dlrover_plugin_flashckpt.hygiene import forget_shm_dirs, recorded_shm_dirs, remove_job

    lines = [f"removed flash-checkpoint buffer {os.path.join(d, name)}"
             for d in recorded_shm_dirs(job) or [DEFAULT_SHM_DIR]
             for name in remove_job(d, job)]
    forget_shm_dirs(job)
    return lines


@hookimpl
def dlrover_job_finished(job: str, summary: dict, emit: Any, spec: Any) -> None:
    _PERSISTER_PIDS.pop(job, None)
    try:
        import ray

        from dlrover_plugin_flashckpt.persister import (
            DEFAULT_SHM_DIR,
            finish_job,
            persisters_of,
        )

        if not ray.is_initialized():
            return
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(_kv_key(job), namespace=_KV_NAMESPACE)
        run_id = ray.get_runtime_context().get_actor_id()
        shm_dirs = shm_dirs_of(spec) if spec is not None else [DEFAULT_SHM_DIR]
        if not persisters_of(job):
            from dlrover_plugin_flashckpt.hygiene import current_session, remove_job

            kept: list[dict] = []
            for d in shm_dirs:
                remove_job(d, job, run_id, current_session(), keep_unpersisted=True, kept=kept)
            report = {"": {"not_persisted": kept}}
        else:
            report = finish_job(job, run_id, FINISH_TIMEOUT_S, shm_dirs or None)
        log.info("flash checkpoint cleanup of %s: %s", job, report)
        lost = [{**k, "node": node} for node, r in report.items()
                for k in r.get("not_persisted", [])]
        if lost:
            # the caller writes summary.json again after this hook
            summary["checkpoint_not_persisted"] = lost
            log.warning("job %s ended with saves that are not on disk; their shared-memory "
                        "buffers are kept (`dlrover flash ls`): %s", job,
                        ", ".join(f"{k['role']} rank {k['rank']} step {k['step']}"
                                  for k in lost))
        emit("flash_cleanup", report=report)
    except Exception as exc:  # noqa: BLE001
        log.warning("flash checkpoint cleanup of %s failed: %s", job, exc)


@hookimpl
def dlrover_cli_commands(cli: Any) -> None:
    from dlrover_plugin_flashckpt.cli import add_commands

    add_commands(cli)
