"""The ``flash`` saver's case: ranks without a process group (they agree through the
gather board, a Ray actor), each a process joined to the harness's Ray cluster with a
:class:`FlashSaver`; the node's persister is a Ray actor the harness creates per run
(named as :func:`get_persister` names it, so the ranks find it), with the crash point
armed in its environment for the persist, commit and prune points. A step counts as
committed once a ``wait()`` that followed its save returned.

Variant ``wipe_shm``: the job's shared memory is removed before the restart (a node
that lost its memory), so the restart loads from disk."""

from __future__ import annotations

import os
import re
from typing import Any

NAME = "flash"
PREFIX = "flash."
DURABLE_AFTER = "wait"
MODULES = ["dlrover_plugin_flashckpt.saver", "dlrover_plugin_flashckpt.persister",
           "dlrover_plugin_flashckpt.loading", "dlrover_plugin_flashckpt.slots",
           "dlrover_plugin_flashckpt.storage", "dlrover_plugin_flashckpt.persisting",
           "dlrover_plugin_flashckpt.shm", "dlrover_plugin_flashckpt.lineage"]
SHM_DIR = "/dev/shm"

#: the fault phase: :data:`.plan.FAULT_OPS` with a ``wait`` after the save of 20, so that
#: 10 and 20 are persisted before 30 is saved: 30 then takes 10's buffer and the rollback
#: ``load(20)`` reads 20 from shared memory. Without it a persister slow to take up 10
#: (a loaded machine) lets the save of 30 replace 20 before 20 was persisted (a save never
#: waits), the rollback finds 20 nowhere, and no fault-free run reaches the memory load's
#: points (CI, 2026-11-30: ``flash.load.memory_read never reached``)
FAULT_OPS: list[tuple] = [("load", None), ("save", 10), ("save", 20), ("wait",), ("save", 30),
                          ("wait",), ("load", 20), ("save", 25), ("save", 35), ("wait",),
                          ("close",)]
OPTIONS = {"wait_timeout_s": 20, "persist_every_steps": 1}
_COMMIT_LOCK_RE = re.compile(r"^\.step_\d{8,}\.commit$")
_RAY: dict = {}


def _import_all() -> None:
    import importlib

    for m in MODULES:
        try:
            importlib.import_module(m)
        except ImportError:  # a module the plugin no longer has
            pass


#: the fault-free trace run's variant (flash: the memory wiped, so that the restart
#: reaches the disk load's points)
TRACE_VARIANT: dict = {"wipe_shm": True}


def target(point) -> str | None:
    """The persister for persist, commit and prune points; else the rank that reaches
    the point."""
    return "persister" if point.area in ("persist", "commit", "prune") else None


#: rank counts and faults of the quick subset (a flash run takes seconds: Ray, the
#: persister)
QUICK_WORLDS = (2,)
QUICK_FAULTS = ("sigkill",)


def variants(point, fault: str, world: int, quick: bool) -> list[dict]:
    """The node's memory kept; for SIGKILL with 2 ranks (not ``quick``) also wiped
    before the restart."""
    return [{}, {"wipe_shm": True}] if world == 2 and fault == "sigkill" and not quick \
        else [{}]


def nths(count: int, world: int, quick: bool) -> list[int]:
    """Which hit of a point (``count`` in the fault-free run) is faulted: the first,
    and with 4 ranks the last (after the rollback): one run per (point, fault, ranks),
    so that the whole enumeration ends within 15 minutes on 2 cores."""
    if count < 1:
        return []
    return [count] if world == 4 and not quick else [1]


def ensure_ray() -> str:
    """Start the harness's Ray cluster once (in this process); returns its address."""
    if not _RAY:
        from dlrover_core.testing import start_test_ray

        start_test_ray(num_cpus=4)
        import ray

        _RAY["address"] = ray.get_runtime_context().gcs_address
    return _RAY["address"]


def begin_run(info: dict) -> dict:
    """Create the run's persister (armed when ``info["arm"]``, tracing to
    ``info["trace"]``); returns ``{"address", "persister", "pid"}``."""
    import ray

    from dlrover_plugin_flashckpt import handles, hygiene

    address = ensure_ray()
    env = {"DLROVER_CRASHPOINT_TRACE": info["trace"]}
    if info.get("arm"):
        a = info["arm"]
        env.update(DLROVER_CRASHPOINT=f"{a['name']}@{a['nth']}", DLROVER_CRASHPOINT_FAULT=a["fault"])
    node = ray.get_runtime_context().get_node_id()
    handle = _remote_class().options(
        name=handles.persister_name(info["job"], node), namespace=handles.NAMESPACE,
        lifetime="detached", num_cpus=0, max_concurrency=16, max_restarts=0,
        runtime_env={"env_vars": env},
    ).remote(info["job"], hygiene.current_session(), node, SHM_DIR)
    pid = ray.get(handle.status.remote(), timeout=60)["pid"]
    return {"address": address, "persister": handle, "pid": pid, "job": info["job"]}


def _remote_class():
    """The persister's Ray class (wherever the plugin defines ``remote_class`` now)."""
    from dlrover_plugin_flashckpt import handles, persister

    make = getattr(handles, "remote_class", None) or getattr(persister, "remote_class")
    return make()


def pids(ctx: dict) -> dict[int, str]:
    return {ctx["pid"]: "persister"}


def setup_rank(spec: dict) -> None:
    """Join the harness's Ray cluster (its address in ``spec["ray"]``)."""
    from dlrover_core.master.client import init_ray

    init_ray(spec["ray"])


def teardown_rank(spec: dict) -> None:
    """Nothing: the process ends."""


def make_saver(spec: dict) -> Any:
    from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
    from dlrover_plugin_flashckpt.saver import FlashSaver

    from crashtest.plan import KEEP

    return FlashSaver(SaverConfig(dir=spec["ckpt"], keep=KEEP, job=spec["job"],
                                  options=dict(OPTIONS)),
                      SaverContext(rank=spec["rank"], world_size=spec["world"], role="trainer"))


def save(saver: Any, spec: dict, step: int, state: dict) -> None:
    saver.save(step, state)


def load(saver: Any, spec: dict, state: dict, step: int | None) -> int | None:
    return saver.load(state, step)


def rank_report(saver: Any) -> dict:
    return {}


def committed(ckpt: str) -> list[int]:
    """Steps with a ``step_<n>/manifest.json`` (the raw listing; the lineage is the
    harness's own, from the journals)."""
    from dlrover_core.checkpoint.saver import committed_steps

    return committed_steps(ckpt)


def _headers(job: str) -> list:
    from dlrover_plugin_flashckpt import shm

    out = []
    for path in shm.list_segments(SHM_DIR, shm.job_prefix(job)):
        try:
            seg = shm.Segment.attach(path)
        except (OSError, ValueError):
            continue
        if seg is None:
            continue
        try:
            out.append(seg.read_header())
        finally:
            seg.close()
    return out


def memory_steps(job: str, world: int) -> list[int]:
    """Steps held READY (or being persisted) in memory by every rank of ``world``."""
    from dlrover_plugin_flashckpt import shm

    held: dict[int, set[int]] = {r: set() for r in range(world)}
    for h in _headers(job):
        if shm.holds_step(h) and h.rank in held:
            held[h.rank].add(h.step)
    return sorted(set.intersection(*held.values())) if held else []


def _disarm(actor: Any) -> None:
    """Run in the persister's process (``__ray_call__``): disarm its crash point."""
    from dlrover_core import crashpoints

    crashpoints.arm(None)


def before_restart(run: dict) -> dict:
    """The persister's errors (``reports``), the steps in memory on every rank
    (``memory``); the persister, when alive, is disarmed; with ``wipe_shm`` the job's
    buffers are removed afterwards."""
    import ray

    from dlrover_plugin_flashckpt import hygiene

    ctx = run["ctx"]
    reports: list[str] = []
    try:
        reports = list(ray.get(ctx["persister"].status.remote(), timeout=10)["errors"])
        # the restart runs disarmed: a hit the fault phase did not reach must not fire now
        ray.get(ctx["persister"].__ray_call__.remote(_disarm), timeout=10)
    except Exception as exc:  # noqa: BLE001 - a dead persister is itself the report
        reports = [f"persister gone: {type(exc).__name__}"]
    memory = memory_steps(ctx["job"], run["world"])
    if run.get("wipe_shm"):
        hygiene.remove_job(SHM_DIR, ctx["job"])
        memory = []
    return {"reports": reports, "memory": memory}


def wedged(run: dict) -> list[str]:
    """After the restart: commit locks (``.step_<n>.commit``) left in the folder, slots
    still claimed PERSISTING by a live persister or WRITING, a commit lock that cannot
    be taken."""
    from dlrover_plugin_flashckpt import commitlock, shm

    ckpt = os.path.join(run["run_dir"], "ckpt")
    out = [f"commit lock {n} left in the checkpoint folder" for n in
           (sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []) if _COMMIT_LOCK_RE.match(n)]
    for h in _headers(run["ctx"]["job"]):
        state = shm.effective_state(h)
        if state in (shm.WRITING, shm.PERSISTING):
            out.append(f"rank {h.rank} slot of step {h.step} stuck "
                       f"{shm.STATE_NAMES[state]} after the restart")
    path = commitlock.lock_path(ckpt, 999_999)
    if not os.path.isdir(ckpt):
        return out + ["no checkpoint folder after the restart"]
    try:
        lease = commitlock.take(path)
        if lease is None:
            out.append("a fresh commit lock could not be taken")
        else:
            commitlock.release(path, lease)
    except OSError as exc:
        out.append(f"a fresh commit lock could not be taken: {exc}")
    return out


def end_run(run: dict) -> None:
    """Stop the run's persister and remove the job's buffers."""
    import ray

    from dlrover_plugin_flashckpt import handles, hygiene

    try:
        ray.kill(ray.get_actor(handles.persister_name(
            run["ctx"]["job"], ray.get_runtime_context().get_node_id()),
            namespace=handles.NAMESPACE), no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
    hygiene.remove_job(SHM_DIR, run["ctx"]["job"])
