"""Issue 28 item 9: ranks without a process group agree on the step they restore.
Two real ranks (Ray actors, each with its own FlashSaver and no torch.distributed
group); the node loses rank 1's buffer of the newest step (the file is removed from
outside)."""

from __future__ import annotations

import os
import uuid

import ray

from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.persister import finish_job
from dlrover_plugin_flashckpt.testing_workloads import SaverRank


def test_ranks_without_a_group_restore_the_same_step(ray_cluster, tmp_path):
    job = f"flashagree-{uuid.uuid4().hex[:6]}"
    ckpt = str(tmp_path / "ckpt")
    options = {"persist_every_steps": 100, "wait_timeout_s": 60}  # steps 1, 2: memory only
    actor = ray.remote(SaverRank).options(num_cpus=0)
    try:
        ranks = [actor.remote(job, ckpt, r, 2, options) for r in range(2)]
        for step in (1, 2):
            ray.get([a.save.remote(step) for a in ranks])
        for a in ranks:
            ray.kill(a)
        lost = []
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            seg = shm.Segment.attach(path)
            h = seg.read_header()
            seg.close()
            if (h.rank, h.step) == (1, 2):
                os.unlink(path)
                lost.append(path)
        assert len(lost) == 1
        again = [actor.remote(job, ckpt, r, 2, options) for r in range(2)]
        loads = ray.get([a.load.remote() for a in again], timeout=180)
        # rank 0 still holds step 2, rank 1 only step 1: both restore step 1
        assert [(x["step"], x["source"], x["exact"]) for x in loads] == [
            (1, "memory", True), (1, "memory", True)]
        for a in again:
            ray.kill(a)
    finally:
        finish_job(job, timeout=30)
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            os.unlink(path)
