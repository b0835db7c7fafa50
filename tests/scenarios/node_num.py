"""Scenario: ``node_num(2)`` on a ``ray.cluster_utils.Cluster`` of a CPU-less head and
two 2-CPU worker nodes; the trainer role's 2 ranks (``per_node`` unset) must land on
distinct nodes. Run as ``python -m tests.scenarios.node_num JOB_DIR``; prints one JSON
line: the exit code, the probe file and the worker node ids."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster

from dlrover_core import DLJobBuilder
from dlrover_core.master.client import init_ray


def main(job_dir: str) -> None:
    temp_dir = tempfile.mkdtemp(prefix="dlnn", dir="/tmp")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "temp_dir": temp_dir,
                                      "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2).node_id for _ in range(2)]
    cluster.wait_for_nodes()
    init_ray(cluster.address)
    rc = (DLJobBuilder().dl_type("SFT").node_num(2).skip_node_check()
          .trainer("tests.api_programs", "ProbeTrainer")
          .workload("tests.api_programs", "ProbeWorkload").total(2).resource(cpu=1)
          .failover(standby=False).build().submit(job_dir=job_dir))
    probe = None
    if os.path.exists(os.path.join(job_dir, "probe.json")):
        probe = json.load(open(os.path.join(job_dir, "probe.json")))
    print(json.dumps({"rc": int(rc), "error": rc.get("error"), "probe": probe,
                      "workers": workers}))
    sys.stdout.flush()
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
