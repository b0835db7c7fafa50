"""Scenario: an elastic role (``nodes: "1:2"``, one rank per node) on a 3-node
``ray.cluster_utils.Cluster`` (a 1-CPU head, two 2-CPU workers). At step
``--remove-at`` the node of trainer rank 1 is removed for real; no replacement comes
within ``elastic.replacement_timeout_s``, so the trainer shrinks to 1 rank. At step
``--add-at`` a new node joins; the trainer grows back to 2 ranks at its next
checkpoint. A second role (``watcher``) runs throughout and must never restart.

Run as ``python -m tests.scenarios.elastic_resize JOB_DIR [saver]``; prints one JSON line:
the summary, the per-step losses of rank 0 (the last report of each step), the removed
node, and where each start restored from."""

from __future__ import annotations

import json
import os
import sys

from dlrover_core import load_spec
from dlrover_core.master.events import read_events
from dlrover_core.testing import master_node_id, multinode_cluster, run_job
from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.replica_buffers import parse_replica

G, B, STEPS, EVERY = 8, 4, 50, 5
REMOVE_AT, ADD_AT = 20, 32


def job_spec(saver: str):
    options = {"replicas": 1, "wait_timeout_s": 60} if saver == "flash" else {}
    return load_spec({
        "name": "elastic-resize",
        "roles": {
            "trainer": {"workload": "tests.elastic_workloads:ElasticRegression", "total": 2,
                        "per_node": 1, "nodes": "1:2", "backend": "ddp",
                        "resources": {"cpu": 2}},
            "watcher": {"workload": "tests.elastic_workloads:Watcher", "total": 1,
                        "resources": {"cpu": 1}}},
        "checkpoint": {"saver": saver, "every_steps": EVERY, "keep": 2, "options": options},
        "failover": {"standby": False, "survivor_grace_s": 3, "pg_timeout_s": 30,
                     "max_restarts": 5},
        "elastic": {"replacement_timeout_s": 2, "poll_interval_s": 1,
                    "global_batch": G, "micro_batch": B},
        "config": {"max_steps": STEPS,
                   "batches_per_shard": 1, "sleep_s": 0.25}})


def replicated_step(job_dir: str, rank: int) -> int:
    """The newest step of trainer ``rank``'s flash save that a replica buffer in
    ``/dev/shm`` holds complete (every node of this one-machine cluster shares it), for
    a checkpoint folder under ``job_dir``; -1 when none."""
    return newest_replica(job_dir, rank)[0]


def newest_replica(job_dir: str, rank: int) -> tuple[int, str]:
    """``(step, holder node id prefix)`` of :func:`replicated_step`'s replica (``(-1,
    "")`` when none)."""
    best, holder = -1, ""
    for name in os.listdir("/dev/shm"):
        parsed = parse_replica(name)
        if parsed is None or parsed[0] != rank:
            continue
        seg = shm.Segment.attach(os.path.join("/dev/shm", name))
        if seg is None:
            continue
        try:
            h, ident = seg.read_header(), seg.ident()
        finally:
            seg.close()
        if str(ident.get("dir", "")).startswith(job_dir) and h.state == shm.READY \
                and h.step > best:
            best, holder = h.step, parsed[2]
    return best, holder


def main(job_dir: str, saver: str = "disk") -> None:
    seen: dict = {"removed": None, "added": None}
    with multinode_cluster(workers=2, cpus=2, head_cpus=1) as (cluster, workers):

        def resize(st: dict) -> None:
            inst = st["instances"]
            step = inst.get("trainer-0", {}).get("step", -1)
            if seen["removed"] is None and step >= REMOVE_AT:
                # a trainer node without the JobMaster (Ray puts the master on any node of
                # this one-machine cluster; losing it is a master restart, not this test)
                master_node = master_node_id(job_dir)
                rank, node = next((r, inst[f"trainer-{r}"]["node_id"]) for r in (1, 0)
                                  if inst[f"trainer-{r}"]["node_id"] != master_node)
                # with the flash saver, only once the removed rank's save of the step
                # reached (or of a later one) is replicated on another node: else the
                # persister can commit a step the replicas lack yet, and the shrink then
                # rightly loads that newer step from disk (seen on a loaded CI machine)
                # (waited for until 2 checkpoints before the node joins, at most)
                if saver == "flash" and step < ADD_AT - 2 * EVERY and \
                        replicated_step(job_dir, rank) < step // EVERY * EVERY:
                    return
                seen["removed"], seen["removed_step"] = node, step
                seen["survivor"] = inst[f"trainer-{1 - rank}"]["node_id"]
                seen["replicated"], seen["replica_holder"] = \
                    newest_replica(job_dir, rank) if saver == "flash" else (None, None)
                cluster.remove_node(workers[node])
            if seen["removed"] is not None and seen["added"] is None and step >= ADD_AT:
                seen["added"] = cluster.add_node(num_cpus=2).node_id

        summary = run_job(job_spec(saver), job_dir, resize, timeout=400, interval=0.2)
    losses: dict[int, float] = {}
    for r in read_events(os.path.join(job_dir, "metrics.jsonl")):
        if r["event"] == "step" and r["role"] == "trainer" and "loss" in r:
            losses[int(r["step"])] = float(r["loss"])
    loads = []
    path = os.path.join(job_dir, "loads.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            loads = [json.loads(line) for line in f if line.strip()]
    print(json.dumps({"summary": summary, "removed_node": seen["removed"],
                      "removed_at_step": seen.get("removed_step"),
                      "replicated_step": seen.get("replicated"),
                      "replica_holder": seen.get("replica_holder"),
                      "survivor_node": seen.get("survivor"),
                      "added_node": seen["added"], "losses": losses, "loads": loads}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), *(sys.argv[2:3]))
