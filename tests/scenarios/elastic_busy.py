"""Scenario: an elastic role on a cluster it shares. A 4-node ``ray.cluster_utils.Cluster``
(a 1-CPU head, three 2-CPU workers); the trainer (``nodes: "1:3"``, one 2-CPU rank per
node, ``batches_per_shard`` 4) starts at 2 ranks while another job (a placement group
this driver makes) holds 1 CPU of the third worker: by its total resources the node
would hold a third rank, by what is free it does not. At step ``RELEASE_AT`` the other
job lets go and the trainer grows to 3 ranks at its next checkpoint. Once it runs at 3
ranks past step ``REMOVE_AT``, the node of a trainer rank (not the JobMaster's) is
removed for real: the trainer shrinks to 2 ranks and asks the cluster for the lost
node back. It trains to the end of the data at 2 ranks.

Run as ``python -m tests.scenarios.elastic_busy JOB_DIR``; prints one JSON line: the
summary, the events of the elastic manager (with their times), when the other job let
go, and the removed node."""

from __future__ import annotations

import json
import os
import sys
import time

from dlrover_core import load_spec
from dlrover_core.master.events import read_events
from dlrover_core.testing import master_node_id, multinode_cluster, run_job

G, B, STEPS, EVERY = 12, 2, 32, 4  # 12 samples per step: 2 micro-batches of 2 at 3 ranks
RELEASE_AT, REMOVE_AT = 8, 18
EVENTS = ("elastic_room", "elastic_resized", "elastic_grow_dropped", "elastic_placement_failed",
          "elastic_resources_requested", "instance_failed", "job_state_changed")


def job_spec():
    return load_spec({
        "name": "elastic-busy",
        "roles": {"trainer": {"workload": "tests.elastic_workloads:ElasticRegression",
                              "total": 2, "per_node": 1, "nodes": "1:3", "backend": "ddp",
                              "resources": {"cpu": 2}}},
        "checkpoint": {"saver": "disk", "every_steps": EVERY, "keep": 2},
        "failover": {"standby": False, "survivor_grace_s": 3, "pg_timeout_s": 30,
                     "max_restarts": 5},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "elastic": {"replacement_timeout_s": 1, "poll_interval_s": 0.5,
                    "placement_timeout_s": 10, "global_batch": G, "micro_batch": B},
        "config": {"max_steps": STEPS, "batches_per_shard": 4, "sleep_s": 0.2}})


def main(job_dir: str) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    seen: dict = {"released_ts": None, "removed": None}
    with multinode_cluster(workers=3, cpus=2, head_cpus=1) as (cluster, workers):
        busy_node = sorted(workers)[-1]
        busy = placement_group([{"CPU": 1}], strategy="STRICT_PACK",
                               bundle_label_selector=[{"ray.io/node-id": busy_node}])
        ray.get(busy.ready(), timeout=30)  # the other job holds 1 of busy_node's 2 CPUs

        def on_status(st: dict) -> None:
            inst = st["instances"]
            step = inst.get("trainer-0", {}).get("step", -1)
            if seen["released_ts"] is None and step >= RELEASE_AT:
                remove_placement_group(busy)
                seen["released_ts"] = time.time()
            if seen["removed"] is None and step >= REMOVE_AT and "trainer-2" in inst \
                    and inst["trainer-2"]["state"] == "running":
                master = master_node_id(job_dir)
                seen["removed"] = next(inst[k]["node_id"] for k in
                                       ("trainer-2", "trainer-1", "trainer-0")
                                       if inst[k]["node_id"] != master)
                cluster.remove_node(workers[seen["removed"]])

        summary = run_job(job_spec(), job_dir, on_status, timeout=300, interval=0.2)
    events = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
              if e["event"] in EVENTS]
    print(json.dumps({"summary": summary, "events": events, "busy_node": busy_node,
                      "released_ts": seen["released_ts"], "removed_node": seen["removed"]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
