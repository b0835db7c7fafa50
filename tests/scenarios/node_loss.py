"""Scenario: a node is removed from a 2-node ``ray.cluster_utils.Cluster`` while the
nanogpt job runs on it. Run as ``python -m tests.scenarios.node_loss JOB_DIR``; prints
one JSON line: the summary plus what the scenario saw."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

from dlrover_core import load_spec
from dlrover_core.master.client import create_master, init_ray

TINY = ["name=ft-node", "config.n_layer=1", "config.n_embd=32", "config.n_head=2",
        "config.block_size=32", "config.batch_size=8", "config.eval_batches=1",
        "config.lr=1e-2", "config.warmup_steps=2", "checkpoint.every_steps=4",
        "config.max_steps=20", "config.eval_every=20", "failover.survivor_grace_s=3",
        "failover.pg_timeout_s=30"]


def main(job_dir: str) -> None:
    temp_dir = tempfile.mkdtemp(prefix="dln", dir="/tmp")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir,
                                      "include_dashboard": False})
    workers = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=2)
        workers[node.node_id] = node
    cluster.wait_for_nodes()
    init_ray(cluster.address)
    master = create_master(load_spec("examples/nanogpt/job.yaml", TINY), job_dir)
    ray.get(master.start.remote())
    removed = None
    deadline = time.time() + 300
    summary = None
    while time.time() < deadline:
        try:
            st = ray.get(master.status.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            time.sleep(0.3)
            continue
        if removed is None and st["step"] >= 5:
            node_id = st["instances"]["trainer-0"]["node_id"]
            removed = node_id
            cluster.remove_node(workers[node_id])
        if st["summary"]:
            summary = st["summary"]
            break
        time.sleep(0.2)
    ray.kill(master)
    print(json.dumps({"summary": summary, "removed_node": removed,
                      "worker_nodes": sorted(workers)}))
    sys.stdout.flush()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
