"""Checkpointed FSDP2 jobs at a real size: 2 ranks with about 1 GiB of training state
each (parameter shards and AdamW's two moments, float32). Rank 1 SIGKILLed right after a
save, both ranks restored from shared memory (flash saver) or from disk (the core's
``disk`` saver): the state each rank loads is the one it saved, byte for byte (its
digest), and the job ends. And the 2 GiB saved by 2 ranks restored into 1 rank (a
second run of the job at world size 1, resharded from disk)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from dlrover_core import load_spec
from dlrover_core.checkpoint.saver import committed_steps
from dlrover_core.master.events import read_events
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


def loads_of(job_dir: str) -> list[dict]:
    """The job's ``checkpoint_loaded`` events (rank 0's loads), in order."""
    return [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
            if e["event"] == "checkpoint_loaded"]


@pytest.mark.slow
def test_fsdp_1gib_per_rank_disk_saver_sigkill_restores_from_disk(ray_cluster, job_dir):
    """The core's ``disk`` saver (DCP, committed with a manifest) at about 1 GiB per
    rank: rank 1 SIGKILLed right after the committed save of step 4; both ranks load
    step 4 from disk, each the tensors it saved (sha256 of every local tensor)."""
    name = f"fsdpdisk-{uuid.uuid4().hex[:6]}"
    ckpt = os.path.join(job_dir, "ckpt")
    out = os.path.join(job_dir, "digests")
    os.makedirs(out)
    spec = load_spec({
        "name": name,
        "roles": {"trainer": {"workload": WORKLOAD, "total": 2, "backend": "fsdp",
                              "resources": {"cpu": 0.5}}},
        "failover": {"max_restarts": 2, "standby": False, "pg_timeout_s": 120,
                     "in_place": False},
        # one save (step 4, 2 GiB on disk) before the kill, none after it
        "checkpoint": {"saver": "disk", "dir": ckpt, "every_steps": 4, "keep": 1},
        "config": {"max_steps": 5, "kill_step": 4, "kill_rank": 1, "out": out,
                   "tensor_digests": True},
    })
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["total"] == 1
    step_dir = os.path.join(ckpt, "trainer", "step_00000004")
    for rank in (0, 1):
        saved = read(os.path.join(out, f"saved-{rank}.json"))
        loaded = read(os.path.join(out, f"loaded-{rank}-1.json"))
        assert saved["step"] == 4 and saved["bytes"] > 0.95 * GIB, saved  # the real size
        assert loaded["step"] == 4 and loaded["source"] == "disk", loaded["source"]
        # every tensor (184 M parameters' shards, both moments, the steps) byte for byte
        # 22 parameters (11 layers' weight and bias), each with exp_avg, exp_avg_sq, step
        assert len(saved["tensors"]) == 4 * 2 * 11
        assert loaded["tensors"] == saved["tensors"]
        assert {k: loaded[k] for k in ("sum", "squares", "bytes")} == \
               {k: saved[k] for k in ("sum", "squares", "bytes")}
    assert not os.path.exists(os.path.join(out, "loaded-0-0.json"))  # nothing to load at first
    # the recovery is an event of attempt 1 (the run itself started from nothing)
    assert [(e["step"], e["source"], e["path"], e["attempt"]) for e in loads_of(job_dir)] \
        == [(4, "disk", step_dir, 1)]
    assert summary["resumed_from"] is None
    assert committed_steps(os.path.join(ckpt, "trainer")) == [4]
    assert shm.list_segments("/dev/shm", shm.job_prefix(name)) == []  # no shared memory


@pytest.mark.slow
def test_fsdp_2gib_saved_by_2_ranks_restored_into_1_rank(ray_cluster, job_dir):
    """2 GiB of state in all: 2 FSDP2 ranks (about 1 GiB each) flash-save step 4 and
    end (the job's end persists it); a second run of the job at world size 1 resumes
    from it, resharded from the 2 ranks' files (its own shared memory is gone with the
    first run): every tensor's rows that rank r saved equal, byte for byte (sha256),
    those rows of the full tensor loaded; it trains on and saves at world size 1."""
    name = f"fsdpreshard-{uuid.uuid4().hex[:6]}"
    ckpt = os.path.join(job_dir, "ckpt")
    outs = [os.path.join(job_dir, f"digests-{i}") for i in (1, 2)]
    for d in outs:
        os.makedirs(d)

    def spec(total: int, max_steps: int, out: str, **config):
        return load_spec({
            "name": name,
            "roles": {"trainer": {"workload": WORKLOAD, "total": total, "backend": "fsdp",
                                  "resources": {"cpu": 0.5}}},
            "failover": {"max_restarts": 0, "standby": False, "pg_timeout_s": 120},
            # one slot per rank: 2 GiB of buffers in either run
            "checkpoint": {"saver": "flash", "dir": ckpt, "every_steps": 2, "keep": 1,
                           "options": {"slots": 1, "persist_every_steps": 1000}},
            "config": {"max_steps": max_steps, "kill_step": 4, "kill_rank": -1, "out": out,
                       "tensor_digests": True, **config},
        })

    first = submit_job(spec(2, 4, outs[0]), job_dir=job_dir, progress=False)
    assert first["status"] == "succeeded", first["error"]
    assert committed_steps(os.path.join(ckpt, "trainer"))[-1] == 4  # the job's end
    assert shm.list_segments("/dev/shm", shm.job_prefix(name)) == []
    saved = [read(os.path.join(outs[0], f"saved-{r}.json")) for r in (0, 1)]
    assert all(s["step"] == 4 and s["bytes"] > 0.95 * GIB for s in saved), saved

    second = submit_job(spec(1, 6, outs[1], slices_of=2), job_dir=job_dir, progress=False)
    assert second["status"] == "succeeded", second["error"]
    assert second["run"] == 2 and second["resumed_from"]["trainer"]["step"] == 4
    assert second["resumed_from"]["trainer"]["source"] == "disk-resharded"
    loaded = read(os.path.join(outs[1], "loaded-0-0.json"))
    assert (loaded["step"], loaded["source"], loaded["world_size"]) == \
           (4, "disk-resharded", 1)
    # the shards add up; AdamW's 22 float32 steps (one per parameter) are whole on each
    assert loaded["bytes"] > 1.9 * GIB
    assert loaded["bytes"] == saved[0]["bytes"] + saved[1]["bytes"] - 22 * 4
    assert sorted(loaded["slices"]) == sorted(saved[0]["tensors"]) \
        == sorted(saved[1]["tensors"])
    for tensor, parts in loaded["slices"].items():
        for r in (0, 1):
            mine = saved[r]["tensors"][tensor]
            assert parts[r] == {"hex": mine["hex"], "rows": mine["rows"]}, (tensor, r)
        if loaded["tensors"][tensor]["shape"]:  # a sharded tensor: the shards cover it
            assert [saved[0]["tensors"][tensor]["rows"][0],
                    saved[1]["tensors"][tensor]["rows"][1]] == \
                   loaded["tensors"][tensor]["rows"], tensor
    assert committed_steps(os.path.join(ckpt, "trainer"))[-1] == 6  # saved at world size 1
    assert shm.list_segments("/dev/shm", shm.job_prefix(name)) == []
    assert persisters_of(name) == {}
