"""Scenario: ``node_num(2)`` on a ``ray.cluster_utils.Cluster`` of a CPU-less head and
two 2-CPU worker nodes; the trainer role's 2 ranks (``per_node`` unset) must land on
distinct nodes. Run as ``python -m tests.scenarios.node_num JOB_DIR``; prints one JSON
line: the exit code, the probe file and the worker node ids."""

from __future__ import annotations

import json
import os
import sys

from dlrover_core import DLJobBuilder
from dlrover_core.testing import multinode_cluster


def main(job_dir: str) -> None:
    with multinode_cluster(workers=2, cpus=2) as (_, workers):
        rc = (DLJobBuilder().dl_type("SFT").node_num(2).skip_node_check()
              .trainer("tests.api_programs", "ProbeTrainer")
              .workload("tests.api_programs", "ProbeWorkload").total(2).resource(cpu=1)
              .failover(standby=False).build().submit(job_dir=job_dir))
    probe = None
    if os.path.exists(os.path.join(job_dir, "probe.json")):
        probe = json.load(open(os.path.join(job_dir, "probe.json")))
    print(json.dumps({"rc": int(rc), "error": rc.get("error"), "probe": probe,
                      "workers": list(workers)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
