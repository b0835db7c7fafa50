"""Scenario: a node that stays alive but is broken. On a 2-node
``ray.cluster_utils.Cluster`` a 2-rank job runs on one node; then that node is declared
broken (listed in ``<job dir>/bad_nodes``), its workers raise ``BadNodeError``, and a
classifier plugin (a fake distribution on ``PYTHONPATH``, loaded by the master through
its entry point) answers ``node`` for it. The master must mark the node bad and place
the job again on the other node, keeping the bad one out with the placement groups'
label selector while it is still alive.

Run as ``python -m tests.scenarios.bad_node JOB_DIR``; prints one JSON line: the summary
plus what the scenario saw."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import ray

from dlrover_core import DLJobBuilder
from dlrover_core.testing import make_fake_dist, multinode_cluster, run_job

CLASSIFIER = '''
from dlrover_core import hookimpl
from dlrover_core.plugins.records import FailureVerdict


@hookimpl
def dlrover_classify_failure(failure, history):
    if failure.exc_type.endswith("BadNodeError"):
        return FailureVerdict("node", "hardware fault reported by the worker")
    return None
'''


def main(job_dir: str) -> None:
    plugin_dir = Path(tempfile.mkdtemp(prefix="dlbn"))
    make_fake_dist(plugin_dir, "dlrover-plugin-badnode", "badnode", CLASSIFIER)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(plugin_dir), os.getcwd(), os.environ.get("PYTHONPATH", "")])
    seen: dict = {"bad": None}

    def mark_bad(st: dict) -> None:
        if seen["bad"] is None and st["step"] >= 5:
            seen["bad"] = st["instances"]["trainer-0"]["node_id"]
            Path(job_dir, "bad_nodes").write_text(seen["bad"] + "\n")

    with multinode_cluster(workers=2, cpus=2):
        job = (DLJobBuilder().name("ft-badnode").config({"steps": 40, "sleep_s": 0.1})
               .workload("trainer", "tests.workloads", "NodeSensitive").total(2).per_node(2)
               .resource(cpu=1).build())
        summary = run_job(job.spec, job_dir, mark_bad, timeout=300, interval=0.2)
        alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        print(json.dumps({"summary": summary, "bad_node": seen["bad"], "alive_nodes": alive}))
        sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
