"""An MPMD job with a driver: role groups bound as RG_<ROLE>, DRefs between roles."""

from __future__ import annotations

import json
import os

from dlrover_core import DLJobBuilder


def test_driver_job_moves_drefs_between_roles(ray_cluster, job_dir):
    job = (DLJobBuilder().name("mpmd").trainer("tests.workloads", "PingDriver")
           .config({"n": 3})
           .workload("producer", "tests.workloads", "Echo").total(2).resource(cpu=0.5)
           .workload("consumer", "tests.workloads", "Echo").total(2).resource(cpu=0.5)
           .edge("producer", "consumer")
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["metrics"]["consumed"] == 6.0
    events = [json.loads(line) for line in open(os.path.join(job_dir, "events.jsonl"))]
    started = [e for e in events if e["event"] == "instance_started"]
    assert sorted((e["role"], e["rank"]) for e in started) == [
        ("consumer", 0), ("consumer", 1), ("driver", 0), ("producer", 0), ("producer", 1)]
