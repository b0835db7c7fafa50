"""Each attempt's log starts with the framework's lines (role, rank, world size, node,
device, backend, the checkpoint restored), records every save and why the attempt
ended; the workload's logging records and warnings land there too. A real 2-rank DDP
job (gloo) whose rank 1 raises once: attempt 0 and attempt 1 of that rank."""

from __future__ import annotations

import os
import re

from dlrover_core import load_spec
from dlrover_core.runtime.log_capture import attempt_path
from dlrover_core.testing import run_job

SPEC = {"name": "attempt-log",
        "roles": {"trainer": {"workload": "tests.attempt_log_workloads:Logged", "total": 2,
                              "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "every_steps": 3, "keep": 2},
        "failover": {"max_restarts": 2, "pg_timeout_s": 30, "survivor_grace_s": 3},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "config": {"max_steps": 8, "fail_at": 5, "step_s": 0.0}}


def test_attempt_logs_have_header_saves_restore_footer_and_user_records(ray_cluster, tmp_path):
    job_dir = str(tmp_path / "job")
    summary = run_job(load_spec(SPEC), job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    a0 = open(attempt_path(job_dir, "trainer", 1, 0)).read()
    a1 = open(attempt_path(job_dir, "trainer", 1, 1)).read()
    head = a0.index("attempt 0 of trainer rank 1/2 (local rank 1/2")
    assert re.search(r"device cpu \(gpu ids \[\]\); backend ddp, rendezvous \S+:\d+", a0)
    assert "ray node " in a0
    assert a0.index("nothing to restore from DiskSaver") > head
    assert "user record: rank 1 set up" in a0 and "UserWarning: user warning from rank 1" in a0
    assert "checkpoint: saved step 3 to DiskSaver" in a0
    assert "checkpoint: saved step 6" not in a0
    assert a0.rstrip().splitlines()[-1].endswith(
        "attempt ended: RuntimeError: injected failure at step 5 (last reported step 4)")
    assert "attempt 1 of trainer rank 1/2" in a1
    # a DDP rank heals from the survivor's live state (dlrover_core.checkpoint.heal)
    assert "checkpoint: restored step 5 from peer" in a1
    assert "checkpoint: saved step 6" in a1
    assert "attempt ended: run() returned at step 7" in a1
    r0 = open(attempt_path(job_dir, "trainer", 0, 0)).read()
    assert "attempt 0 of trainer rank 0/2" in r0 and "user record: rank 0 set up" in r0
    assert os.path.getsize(attempt_path(job_dir, "trainer", 1, 0)) < 100_000
