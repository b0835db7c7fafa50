"""A transient failure while the job starts (before the driver is up) restarts the
start-up as a whole and the job succeeds; the state changes it goes through are the
checked ones. Real Ray actors; the fault is a real exception in user ``setup()``."""

from __future__ import annotations

import json
import os

from dlrover_core import DLJobBuilder


def test_failure_during_startup_restarts_the_startup(ray_cluster, job_dir):
    job = (DLJobBuilder().name("flaky-start").trainer("tests.startup_workloads", "CountDriver")
           .workload("worker", "tests.startup_workloads", "FlakySetup").total(2)
           .resource(cpu=0.5)
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    # (step reports are asynchronous: the last may land after the driver returned)
    assert summary["metrics"]["min_attempt"] == 1.0  # every worker was started again
    assert summary["restarts"]["process"] == 1 and summary["restarts"]["total"] == 1
    events = [json.loads(line) for line in open(os.path.join(job_dir, "events.jsonl"))]
    failed = [e for e in events if e["event"] == "instance_failed"]
    assert [(e["role"], e["rank"], e["phase"], e["exc_type"]) for e in failed] == [
        ("worker", 1, "setup", "ConnectionError")]
    states = [(e["previous"], e["state"]) for e in events if e["event"] == "job_state_changed"]
    assert states == [("pending", "placing"), ("placing", "starting"),
                      ("starting", "recovering"), ("recovering", "starting"),
                      ("starting", "running"), ("running", "succeeded")]
    started = [(e["role"], e["rank"], e["attempt"]) for e in events
               if e["event"] == "instance_started"]
    # worker 0's first setup may or may not have finished before worker 1 failed; the
    # driver starts once, after every worker is set up again (its first attempt)
    assert sorted(s for s in started if s[2] == 1) == [("worker", 0, 1), ("worker", 1, 1)]
    assert [s for s in started if s[0] == "driver"] == [("driver", 0, 0)]
    assert started[-1] == ("driver", 0, 0)
    assert [e["event"] for e in events].count("recovery_finished") == 1
    # the instance table is persisted, with the last step each instance reported
    from dlrover_core.master.context import JobContext

    rows = {(r["role"], r["rank"]): r for r in JobContext(
        os.path.join(job_dir, "context.sqlite")).instances()}
    assert sorted(rows) == [("driver", 0), ("worker", 0), ("worker", 1)]
    assert rows[("driver", 0)]["state"] == "succeeded"
    # reports 0..2 reach the master asynchronously and are persisted on a 2 s timer, so
    # the row holds a step the driver reported (the later ones may land after the final
    # flush); -1 if the row's last_step were never written
    assert rows[("driver", 0)]["last_step"] in (0, 1, 2)
    assert rows[("worker", 1)]["attempt"] == 1
