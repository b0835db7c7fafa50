"""The per-node flash persisters as seen from outside them: their names, finding them
on the live nodes, and the job-wide operations over all of them (a breakpoint save
after a trainer died, the job's end, which of them fail to persist). Imports no torch;
the actor itself is :class:`.persister.FlashPersister`.
"""

from __future__ import annotations

import os
from typing import Any

from dlrover_plugin_flashckpt import hygiene

NAMESPACE = "dlrover"
#: where buffers are looked for at job end when no saver said otherwise
DEFAULT_SHM_DIR = "/dev/shm"


def persister_name(job: str, node_id: str) -> str:
    return f"dlrover-flash-{job}-{node_id[:16]}"


def alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def persisters_of(job: str) -> dict[str, Any]:
    """``node_id -> handle`` of the live persisters of ``job``."""
    import ray

    out = {}
    for node in alive_nodes():
        try:
            out[node] = ray.get_actor(persister_name(job, node), namespace=NAMESPACE)
        except ValueError:
            pass
    return out


def rank_nodes(job: str, timeout: float = 10.0) -> list[str]:
    """The nodes whose persister of ``job`` has ranks registered (a persister that only
    holds other nodes' replicas has none)."""
    import ray

    handles = persisters_of(job)
    got = ray.get([h.ready.remote() for h in handles.values()], timeout=timeout)
    return [node for node, r in zip(handles, got) if r.get("ranks")]


def breakpoint_save(job: str, role: str, timeout: float = 30.0) -> dict:
    """A trainer of ``role`` died: persist the newest step that every rank of the role
    holds in memory and that is not committed yet. Two phases over the job's
    persisters on every node: ask what they hold, then claim that step everywhere
    (the writing goes on in the background). Returns ``{"step": step or None,
    "claimed": {node: [ranks]}, "reason": str}``."""
    import ray

    handles = persisters_of(job)
    if not handles:
        return {"step": None, "claimed": {}, "reason": "no flash persister for this job"}
    answers = dict(zip(handles, ray.get([h.held.remote(role) for h in handles.values()],
                                        timeout=timeout)))
    world = max((a["world_size"] for a in answers.values()), default=0)
    ranks: dict[int, set[int]] = {}
    committed = None
    for a in answers.values():
        for r, steps in a["ranks"].items():
            ranks.setdefault(int(r), set()).update(steps)
        if a["committed"] is not None:
            committed = max(committed or -1, a["committed"])
    if world == 0 or len(ranks) < world:
        return {"step": None, "claimed": {},
                "reason": f"{len(ranks)} of {world} ranks of {role!r} hold a save in memory"}
    common = set.intersection(*ranks.values())
    candidates = [s for s in common if committed is None or s > committed]
    if not candidates:
        return {"step": None, "claimed": {},
                "reason": f"no step newer than the committed {committed} on every rank"}
    step = max(candidates)
    claimed = dict(zip(handles, ray.get([h.breakpoint.remote(role, step)
                                         for h in handles.values()], timeout=timeout)))
    return {"step": step, "claimed": claimed, "reason": "persisting"}


def finish_job(job: str, run_id: str | None = None, timeout: float = 300.0,
               shm_dirs: list[str] | None = None, grace_s: float | None = None) -> dict:
    """End of ``job``: on every alive node, flush and stop the job's persister (waiting
    at most ``timeout`` s for it) and remove the job's buffers (of ``run_id`` when
    given) in the shared-memory directories its savers registered, except buffers
    holding a step newer than the newest commit, which stay (listed under
    ``not_persisted``); returns ``{node: report}`` (see
    :meth:`.persister.FlashPersister.finish`; ``grace_s``: its wait for the other nodes'
    ranks once this node's part of a step is written, default
    :data:`.persister.FINISH_GRACE_S`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def _finish_node(job: str, run_id: str | None, timeout: float,
                     shm_dirs: list[str] | None, grace_s: float | None) -> dict:
        node = ray.get_runtime_context().get_node_id()
        report: dict = {"flushed": {}, "removed": [], "not_persisted": [], "errors": []}
        try:
            handle = ray.get_actor(persister_name(job, node), namespace=NAMESPACE)
        except ValueError:
            handle = None
        if handle is not None:
            try:
                grace = {} if grace_s is None else {"grace_s": grace_s}
                report = ray.get(handle.finish.remote(run_id, timeout, **grace),
                                 timeout=timeout + 5)
            except Exception as exc:  # noqa: BLE001 - stuck or dead: its buffers stay
                report["errors"].append(f"persister: {type(exc).__name__}: {exc}")
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        kept: list[dict] = []
        for d in report.get("shm_dirs") or shm_dirs or [DEFAULT_SHM_DIR]:
            report["removed"] = report.get("removed", []) + hygiene.remove_job(
                d, job, run_id, hygiene.current_session(), keep_unpersisted=True, kept=kept)
        report["not_persisted"] = kept  # what is left now, after the persister's part
        return report

    nodes = alive_nodes()
    refs = [_finish_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n, soft=False)).remote(job, run_id, timeout, shm_dirs, grace_s) for n in nodes]
    out = {}
    for n, ref in zip(nodes, refs):
        try:
            out[n] = ray.get(ref, timeout=timeout + 60)
        except Exception as exc:  # noqa: BLE001
            out[n] = {"errors": [f"{type(exc).__name__}: {exc}"]}
    return out


def crashpoint_env() -> dict:
    """The crash-point variables (``DLROVER_CRASHPOINT*``, :mod:`dlrover_core.crashpoints`)
    of this process, handed to a persister it creates, so that a harness or a test
    arms the persister through the environment of the process that starts it."""
    return {k: v for k, v in os.environ.items() if k.startswith("DLROVER_CRASHPOINT")}


def persist_failures(job: str, timeout: float = 10.0) -> dict[str, dict]:
    """``node_id -> failing state`` (``FlashPersister.status()["failing"]``: ``what``,
    ``error``, ``since``, ``tries``, ...) of every live persister of ``job`` whose
    persisting fails now; ``{}`` when none does. A persister that does not answer within
    ``timeout`` s is listed as ``{"what": "persister", "error": "<why>"}``."""
    import ray

    out: dict[str, dict] = {}
    for node, handle in persisters_of(job).items():
        try:
            failing = ray.get(handle.status.remote(), timeout=timeout).get("failing")
        except Exception as exc:  # noqa: BLE001 - a dead or stuck persister is reported
            failing = {"what": "persister", "error": f"{type(exc).__name__}: {exc}"}
        if failing:
            out[node] = failing
    return out
