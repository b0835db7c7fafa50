"""One run of the harness: a fault phase, a restart, the invariants (see
:mod:`crashtest`); :mod:`crashtest.main` enumerates the runs."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
import uuid

from crashtest import launch
from crashtest.invariants import check
from crashtest.journal import Journal
from crashtest.plan import FAULT_OPS, KEEP, PHASE_TIMEOUT_S, RESTART_OPS

SAVERS = ("disk", "flash", "odl")


def points_of(case) -> list:
    """The crash points of ``case``'s saver, by name (importing the modules that
    declare them)."""
    from dlrover_core import crashpoints

    for m in case.MODULES:
        importlib.import_module(m)
    return [p for n, p in sorted(crashpoints.POINTS.items()) if n.startswith(case.PREFIX)]


def _specs(case, run_dir: str, ckpt: str, job: str, world: int, phase: str, ops: list,
           arm: dict | None, arm_rank: int | None, trace: str | None,
           ctx: dict) -> list[dict]:
    return [{"saver": case.NAME, "rank": r, "world": world, "run_dir": run_dir, "ckpt": ckpt,
             "job": job, "phase": phase, "ops": ops, "trace": trace, "ray": ctx.get("address"),
             "arm": arm if r == arm_rank else None} for r in range(world)]


def hits(trace: str, pids: dict[int, str]) -> dict[str, dict[str, int]]:
    """point name -> {process (``rank<k>`` or another label): times it hit the point}."""
    out: dict[str, dict[str, int]] = {}
    if os.path.exists(trace):
        for line in open(trace):
            pid, _, name = line.strip().partition(" ")
            who = pids.get(int(pid), f"pid{pid}")
            out.setdefault(name, {})[who] = out.get(name, {}).get(who, 0) + 1
    return out


def one_run(case, base: str, world: int, point=None, fault: str | None = None,
            target: str | None = None, nth: int = 1, variant: dict | None = None) -> dict:
    """One run (see :mod:`crashtest`); ``point`` ``None``: the fault-free trace run,
    else ``fault`` at the ``nth`` hit of ``point`` in ``target`` (``rank<k>`` or a
    process the case names). Returns ``{"violations", "hits" (the fault phase's: point
    -> process -> count), "fired", "seconds"}``."""
    t0 = time.monotonic()
    tag = (f"{point.name if point else 'trace'}-{fault or 'none'}@{nth}-{world}"
           + "".join(f"-{k}" for k in sorted(variant or {})))
    run_dir = tempfile.mkdtemp(prefix=tag[-80:] + "-", dir=base)
    ckpt, job = os.path.join(run_dir, "ckpt"), f"crash-{uuid.uuid4().hex[:8]}"
    arm = {"name": point.name, "fault": fault, "nth": nth} if point else None
    arm_rank = int(target[4:]) if target and target.startswith("rank") else None
    at_restart = bool((variant or {}).get("arm_restart"))  # a load point: the resume faults
    trace = os.path.join(run_dir, "trace-fault")
    ctx = case.begin_run({"job": job, "ckpt": ckpt, "run_dir": run_dir, "world": world,
                          "arm": arm if target == "persister" else None, "trace": trace,
                          **(variant or {})})
    fault_out = launch.run_phase(_specs(case, run_dir, ckpt, job, world, "fault",
                                        getattr(case, "FAULT_OPS", FAULT_OPS),
                                        None if at_restart else arm, arm_rank, trace, ctx),
                                 PHASE_TIMEOUT_S)
    ops = getattr(case, "FAULT_OPS", FAULT_OPS)
    run = {"ops": ops, "digest_for": getattr(case, "expected_digest", None), "world": world, "run_dir": run_dir, "keep": KEEP, "durable_after": case.DURABLE_AFTER,
           "fault": fault_out, "ctx": ctx, **(variant or {}),
           "journals": [Journal(os.path.join(run_dir, f"fault-rank{r}.jsonl")).read()
                        for r in range(world)]}
    pids = {o["pid"]: f"rank{o['rank']}" for o in fault_out}
    pids.update(case.pids(ctx))
    fault_hits = hits(trace, pids)
    run.update(case.before_restart(run))
    run["c1"] = case.committed(ckpt)
    if at_restart:  # a first restart whose load passes the armed point; then a clean one
        trace = os.path.join(run_dir, "trace-armed")
        run["armed"] = launch.run_phase(_specs(case, run_dir, ckpt, job, world, "armed",
                                               [("load", None), ("close",)], arm, arm_rank,
                                               trace, ctx), PHASE_TIMEOUT_S)
        pids.update({o["pid"]: f"rank{o['rank']}" for o in run["armed"]})
        fault_hits = hits(trace, pids)
    restart_trace = os.path.join(run_dir, "trace-restart") if point is None else None
    specs = _specs(case, run_dir, ckpt, job, world, "restart", RESTART_OPS, None, None,
                   restart_trace, ctx)
    for spec in specs:  # the self-test's fake wrong resume
        spec["force_load_step"] = (variant or {}).get("wrong_resume")
    run["restart"] = launch.run_phase(specs, PHASE_TIMEOUT_S)
    run["c2"] = case.committed(ckpt)
    run["wedged"] = case.wedged(run)
    run["fired"] = point is not None and fault_hits.get(point.name, {}).get(target, 0) >= nth
    run.setdefault("reports", [])
    run.setdefault("memory", [])
    violations = check(run)
    case.end_run(run)
    restart_hits: dict = {}
    if restart_trace:
        pids.update({o["pid"]: f"rank{o['rank']}" for o in run["restart"]})
        restart_hits = hits(restart_trace, pids)
    if not violations:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"violations": [f"{case.NAME} {tag}: {' | '.join(x.split(chr(10)))} [{run_dir}]"
                           for x in violations],
            "hits": fault_hits, "restart_hits": restart_hits, "fired": run["fired"],
            "seconds": time.monotonic() - t0}
