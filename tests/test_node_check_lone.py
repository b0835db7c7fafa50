"""The pre-flight node check on a cluster of one alive node (the session's local Ray
cluster): it is skipped, with a ``node_check_skipped`` event that ``dlrover diagnose``
prints; no probe starts. (A check of several nodes runs in tests/test_node_health.py.)"""

from __future__ import annotations

import os

import ray

from dlrover_core import load_spec
from dlrover_core.cli.main import main
from dlrover_core.master.events import read_events
from dlrover_core.master.node_check import LONE_NODE
from dlrover_core.testing import run_job


def test_a_one_node_cluster_is_not_checked(ray_cluster, job_dir, capsys):
    spec = load_spec({"name": "lone-node",
                      "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty",
                                            "total": 1, "backend": "ddp",
                                            "resources": {"cpu": 1}}},
                      "failover": {"standby": False},
                      "config": {"max_steps": 2, "step_s": 0.05}})
    assert spec.node_health.skip_node_check is False  # the default: the check is on
    summary = run_job(spec, job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    names = [e["event"] for e in events]
    (skipped,) = [e for e in events if e["event"] == "node_check_skipped"]
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert skipped["nodes"] == [node] and skipped["reason"] == LONE_NODE
    assert "node_check" not in names  # no probe ran
    assert names.index("node_check_skipped") < names.index("instance_started")
    capsys.readouterr()
    assert main(["diagnose", "lone-node", "--job-dir", job_dir]) == 0
    assert f"lone-node: node check skipped: {LONE_NODE}" in capsys.readouterr().out
