"""Scenario: a node is removed from a 2-node ``ray.cluster_utils.Cluster`` while the
nanogpt job runs on it. Run as ``python -m tests.scenarios.node_loss JOB_DIR``; prints
one JSON line: the summary plus what the scenario saw."""

from __future__ import annotations

import json
import os
import sys

from dlrover_core import load_spec
from dlrover_core.testing import multinode_cluster, run_job

TINY = ["name=ft-node", "config.n_layer=1", "config.n_embd=32", "config.n_head=2",
        "config.block_size=32", "config.batch_size=8", "config.eval_batches=1",
        "config.lr=1e-2", "config.warmup_steps=2", "checkpoint.every_steps=4",
        "config.max_steps=20", "config.eval_every=20", "failover.survivor_grace_s=3",
        "failover.pg_timeout_s=30"]


def main(job_dir: str) -> None:
    seen: dict = {"removed": None}
    with multinode_cluster(workers=2, cpus=2) as (cluster, workers):

        def remove_rank0_node(st: dict) -> None:
            if seen["removed"] is None and st["step"] >= 5:
                seen["removed"] = st["instances"]["trainer-0"]["node_id"]
                cluster.remove_node(workers[seen["removed"]])

        summary = run_job(load_spec("examples/nanogpt/job.yaml", TINY), job_dir,
                          remove_rank0_node, timeout=300, interval=0.2)
        print(json.dumps({"summary": summary, "removed_node": seen["removed"],
                          "worker_nodes": sorted(workers)}))
        sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
