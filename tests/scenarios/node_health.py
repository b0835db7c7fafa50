"""Scenario: node health on one 3-node ``ray.cluster_utils.Cluster`` (1 CPU per node),
gloo jobs one after the other, every slowness injected from outside the
code under test:

- ``check``: the pre-flight node check runs (the default); the probe on one node is
  duty-cycled to 5% speed with SIGSTOP/SIGCONT while it measures. That node must be
  excluded and the job placed and run on the other two. Then the node of rank 1 is
  removed (``cluster.remove_node``): the job no longer fits without the excluded node,
  so the recovery must take it back and run there; a new node is added afterwards, for
  the parts that follow.
- ``straggler``: no node check (``skip_node_check``); a plain DDP loop that times
  nothing (``DDPSteps``: the phases come from the ``ddp`` backend's all-reduce hook and
  the reporting layer); once the job runs, rank 1's process is duty-cycled to 30%
  speed; the master must raise ``straggler_detected`` and replace rank 1
  (``straggler_action: replace``) from the warm standby.
- ``shrink``: no node check; an elastic 3-rank trainer; rank 1 slowed as in
  ``straggler``; the master must drop rank 1's node (``straggler_action: shrink``) and
  go on at 2 ranks from the newest checkpoint, never growing back onto that node.
- ``hang``: no node check; rank 1's process is stopped (SIGSTOP); after
  ``hang_timeout_s`` the master must capture the stuck ranks' stacks, name the file in
  the failure, and recover.

Run as ``python -m tests.scenarios.node_health ROOT [PART ...]`` (default: every part
but ``shrink``, which ``tests/test_straggler_shrink.py`` runs alone); prints one JSON line:
part -> what it saw (job directory, summary, injected pids and nodes).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Callable

from dlrover_core import DLJobBuilder, load_spec
from dlrover_core.testing import multinode_cluster, run_job
from tests.node_health_workloads import DutyCycle, parent_pid, probe_pids

W = "tests.node_health_workloads"


def base(name: str, steps: int, **config: Any) -> DLJobBuilder:
    return (DLJobBuilder().name(name)
            .config({"steps": steps, "size": 128, "work": 10, **config})
            .workload("trainer", W, "SyncSteps").total(2).per_node(1).backend("ddp")
            .resource(cpu=1).end())


def part_check(root: str, raylets: dict[int, str], cluster: Any, nodes: dict[str, Any],
               tries: int = 2) -> dict:
    """The probe of the first node seen runs at 20% speed from its start, at 5% once
    it is started; at step 10 of the job the node of rank 1 is removed (then a new node
    is added, once the job ended). When the injector saw no probe process at all (the
    check came and went between its scans on a loaded machine: nothing was tested), the
    job runs again in a new directory, up to ``tries`` times (also when the probe's
    parent was not a raylet of the cluster); ``attempts`` says how many ran."""
    for attempt in range(1, tries + 1):
        out = _check_once(root, raylets, cluster, nodes,
                          "check" if attempt == 1 else f"check-{attempt}")
        out["attempts"] = attempt
        if out["removed"] is not None:
            nodes.pop(out["removed"])
            node = cluster.add_node(num_cpus=1)
            nodes[node.node_id] = node
            cluster.wait_for_nodes()
        if out["slowed_pids"] and out["target_node"]:
            break
    return out


def _check_once(root: str, raylets: dict[int, str], cluster: Any, nodes: dict[str, Any],
                name: str) -> dict:
    # 3000 steps of a few ms, unless restarted: 20 more after the node loss. slow_factor
    # 3, not the default 2: the slowed node measures at 5% speed (20x slower), while
    # healthy nodes here share 2 cores with each other and another suite, and a CI run
    # (of 7c1f64e) judged a healthy node not ok in the check after the exclusion
    job = (base("nh-check", 3000, steps_after_restart=20).failover(standby=False)
           .node_health(matmul_size=512, matmul_iters=40, check_timeout_s=20,
                        slow_factor=3.0).build())
    target: dict[str, Any] = {}
    lost: dict[str, Any] = {"removed": None}

    def slowed() -> list[int]:
        if "ppid" not in target:  # the first probe process seen picks the node
            found = probe_pids()
            if not found:
                return []
            target["ppid"] = parent_pid(found[0])
        pids = probe_pids(ppid=target["ppid"])
        for pid in pids:  # past its start-up (import torch): 5% while it measures
            try:
                if b"__init__" not in open(f"/proc/{pid}/cmdline", "rb").read():
                    cycle.speed = 0.05
            except OSError:  # gone
                pass
        return pids

    cycle = DutyCycle(slowed, speed=0.2, period_s=0.05)
    cycle.start()

    def watch(st: dict) -> None:
        if st["state"] in ("running", "succeeded", "failed") and cycle.is_alive():
            cycle.stop()
        r1 = st["instances"].get("trainer-1", {})
        if lost["removed"] is None and st["state"] == "running" and st["step"] >= 10 \
                and r1.get("node_id") in nodes:
            lost["removed"], lost["ranks_at_removal"] = r1["node_id"], {
                k: v["node_id"] for k, v in st["instances"].items()}
            cluster.remove_node(nodes[r1["node_id"]])

    job_dir = os.path.join(root, name)
    try:
        summary = run_job(job.spec, job_dir, watch, timeout=150)
    finally:
        cycle.stop()
    return {"job_dir": job_dir, "summary": summary,
            "target_node": raylets.get(target.get("ppid", -1)),
            "slowed_pids": sorted(cycle.seen), **lost}


def _rank1_slowed(after_gone: Callable[[dict], None] | None = None) -> tuple:
    """``(seen, watch, cycle)``: ``watch`` (a :func:`run_job` status callback) starts
    ``cycle``, a 30% duty cycle of rank 1's process, at step 30 (``seen`` gets its
    ``pid``, ``node`` and ``slowed_at``), stops it once rank 1 has another pid, and from
    then on calls ``after_gone`` with each status."""
    seen: dict[str, Any] = {}
    cycle = DutyCycle(lambda: [seen["pid"]] if "pid" in seen else [], speed=0.3,
                      period_s=0.05)

    def watch(st: dict) -> None:
        r1 = st["instances"].get("trainer-1", {})
        if "pid" not in seen and st["step"] >= 30 and r1.get("state") == "running":
            seen["pid"], seen["node"] = r1["pid"], r1["node_id"]
            seen["slowed_at"] = time.time()
            cycle.start()
        elif "pid" in seen and r1.get("pid") != seen["pid"]:
            if cycle.is_alive():
                cycle.stop()
            if after_gone is not None:
                after_gone(st)

    return seen, watch, cycle


def part_straggler(root: str) -> dict:
    """A DDP job that times nothing itself (``DDPSteps``); rank 1 runs at 30% speed
    from step 30 until it is replaced."""
    # about 40 ms of compute a step (batch 2048): longer than the duty cycle's period
    job = (DLJobBuilder().name("nh-straggler")
           .config({"steps": 400, "steps_after_restart": 20, "batch": 2048})
           .workload("trainer", W, "DDPSteps").total(2).per_node(1).backend("ddp")
           .resource(cpu=1).end().skip_node_check()
           .node_health(straggler_action="replace", straggler_window_s=1.5,
                        straggler_windows=3).build())
    seen, watch, cycle = _rank1_slowed()
    job_dir = os.path.join(root, "straggler")
    try:
        summary = run_job(job.spec, job_dir, watch, timeout=150)
    finally:
        if cycle.is_alive():
            cycle.stop()
    return {"job_dir": job_dir, "summary": summary, "slowed_pid": seen.get("pid"),
            "slowed_node": seen.get("node"), "slowed_at": seen.get("slowed_at")}


def part_shrink(root: str) -> dict:
    """An elastic trainer (``nodes: "2:3"``, one rank per node, 3 ranks) with
    ``straggler_action: shrink``, flash checkpoints every 10 steps and a standby: rank 1
    runs at 30% speed from step 30 until its process is gone. The master must drop
    rank 1's node (2 ranks on the other two nodes, restored from the newest checkpoint)
    and never grow back onto it nor put the role's spare there, although its CPU is
    free again."""
    job = load_spec({
        "name": "nh-shrink",
        "roles": {"trainer": {"workload": f"{W}:SyncSteps", "total": 3, "per_node": 1,
                              "nodes": "2:3", "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "flash", "every_steps": 10, "keep": 2,
                       "options": {"replicas": 1, "wait_timeout_s": 60}},
        "failover": {"standby": True, "pg_timeout_s": 60},
        "elastic": {"poll_interval_s": 1},
        "node_health": {"skip_node_check": True, "straggler_action": "shrink",
                        "straggler_window_s": 1.5, "straggler_windows": 3},
        "config": {"steps": 200, "size": 128, "work": 300, "checkpoint": True}})
    def spare_warm(st: dict) -> None:
        # the spare may not go to the dropped node (the only free CPU there is)
        seen.setdefault("spare_warm", []).append(st["standby"].get("trainer"))

    seen, watch, cycle = _rank1_slowed(after_gone=spare_warm)
    job_dir = os.path.join(root, "shrink")
    try:
        summary = run_job(job, job_dir, watch, timeout=240)
    finally:
        if cycle.is_alive():
            cycle.stop()
    return {"job_dir": job_dir, "summary": summary, "slowed_pid": seen.get("pid"),
            "slowed_node": seen.get("node"), "slowed_at": seen.get("slowed_at"),
            "spare_warm": seen.get("spare_warm", [])}


def part_hang(root: str) -> dict:
    """Rank 1 is stopped at step 20 (SIGSTOP) and never continued by the test."""
    job = (base("nh-hang", 3000, steps_after_restart=20).skip_node_check()
           .failover(hang_timeout_s=4, pg_timeout_s=60, standby=False).build())
    seen: dict[str, Any] = {}

    def watch(st: dict) -> None:
        r1 = st["instances"].get("trainer-1", {})
        if "pid" not in seen and st["step"] >= 20 and r1.get("state") == "running":
            seen["pid"] = r1["pid"]
            seen["rank0_pid"] = st["instances"]["trainer-0"]["pid"]
            os.kill(r1["pid"], signal.SIGSTOP)

    job_dir = os.path.join(root, "hang")
    try:
        summary = run_job(job.spec, job_dir, watch, timeout=150)
    finally:
        if "pid" in seen:  # killed by the recovery; continue it if it is still there
            try:
                os.kill(seen["pid"], signal.SIGCONT)
            except OSError:
                pass
    return {"job_dir": job_dir, "summary": summary, "stopped_pid": seen.get("pid"),
            "rank0_pid": seen.get("rank0_pid")}


def main(root: str, parts: list[str]) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    with multinode_cluster(workers=3, cpus=1) as (cluster, nodes):
        raylets = {}
        for node in cluster.list_all_nodes():
            for proc in node.all_processes.get("raylet", []):
                raylets[proc.process.pid] = node.node_id
        out = {}
        runners = {"check": lambda: part_check(root, raylets, cluster, nodes),
                   "straggler": lambda: part_straggler(root), "hang": lambda: part_hang(root),
                   "shrink": lambda: part_shrink(root)}
        try:
            for part in parts or ["check", "straggler", "hang"]:
                t0 = time.time()
                out[part] = runners[part]()
                out[part]["wall_s"] = round(time.time() - t0, 1)
        finally:
            print(json.dumps(out, default=str))
            sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), sys.argv[2:])
