"""A flash-checkpointed FSDP2 job at a real size: 2 ranks with about 1 GiB of training
state each (parameter shards and AdamW's two moments, float32), rank 1 SIGKILLed right
after a save, both ranks restored from shared memory: the state each rank loads is the
one it saved, byte for byte (its digest), and the job ends."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from dlrover_core import load_spec
from dlrover_core.checkpoint.saver import committed_steps
from dlrover_core.master.client import submit_job
from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.persister import persisters_of

WORKLOAD = "plugins.fsdp.tests.large_state_workloads:LargeState"
GIB = 1 << 30


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
def test_fsdp_1gib_per_rank_sigkill_restores_from_memory(ray_cluster, job_dir):
    name = f"fsdpbig-{uuid.uuid4().hex[:6]}"
    ckpt = os.path.join(job_dir, "ckpt")
    out = os.path.join(job_dir, "digests")
    os.makedirs(out)
    spec = load_spec({
        "name": name,
        "roles": {"trainer": {"workload": WORKLOAD, "total": 2, "backend": "fsdp",
                              "resources": {"cpu": 0.5}}},
        # in_place=False: the survivor restarts too, so both ranks load
        "failover": {"max_restarts": 2, "standby": False, "pg_timeout_s": 120,
                     "in_place": False},
        # one slot per rank (2 GiB of buffers in all); only the failure's breakpoint
        # save and the job's end write to disk
        "checkpoint": {"saver": "flash", "dir": ckpt, "every_steps": 2, "keep": 1,
                       "options": {"slots": 1, "persist_every_steps": 1000}},
        "config": {"max_steps": 6, "kill_step": 4, "kill_rank": 1, "out": out},
    })
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["total"] == 1
    for rank in (0, 1):
        saved = read(os.path.join(out, f"saved-{rank}.json"))
        loaded = read(os.path.join(out, f"loaded-{rank}-1.json"))
        assert saved["step"] == 4 and saved["bytes"] > 0.95 * GIB, saved  # the real size
        assert loaded["step"] == 4 and loaded["source"] == "memory", loaded
        assert {k: loaded[k] for k in ("sum", "squares", "bytes")} == \
               {k: saved[k] for k in ("sum", "squares", "bytes")}
    assert not os.path.exists(os.path.join(out, "loaded-0-0.json"))  # nothing to load at first
    assert committed_steps(os.path.join(ckpt, "trainer"))[-1] == 6  # the job's end
    assert shm.list_segments("/dev/shm", shm.job_prefix(name)) == []
    assert persisters_of(name) == {}
