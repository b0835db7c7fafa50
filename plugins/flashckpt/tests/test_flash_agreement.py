"""Issue 28 items 9 and 1: ranks without a process group agree on the step they
restore and on their attempt. Two real ranks (Ray actors, each with its own FlashSaver
and no torch.distributed group); faults are injected from outside (a buffer removed, a
stale shard left in a temp directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import ray

from dlrover_core.testing import kill_actors
from dlrover_plugin_flashckpt import shm, storage
from dlrover_plugin_flashckpt.persister import finish_job
from plugins.flashckpt.tests.flash_workloads import SaverRank


@pytest.fixture
def two_ranks(ray_cluster, tmp_path):
    """``start(options)`` starts ranks 0 and 1 of 2 (:class:`SaverRank` actors) of one
    job and checkpoint folder (``start.job``, ``start.ckpt``). Afterwards every rank
    started is killed, the job finished and its buffers removed."""
    job = f"flashagree-{uuid.uuid4().hex[:6]}"
    ckpt = str(tmp_path / "ckpt")
    actor = ray.remote(SaverRank).options(num_cpus=0)
    started: list = []

    def start(options: dict) -> list:
        ranks = [actor.remote(job, ckpt, r, 2, options) for r in range(2)]
        started.extend(ranks)
        return ranks

    start.job, start.ckpt = job, ckpt
    yield start
    kill_actors(started)
    finish_job(job, timeout=30)
    for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
        os.unlink(path)


def test_ranks_without_a_group_restore_the_same_step(two_ranks):
    options = {"persist_every_steps": 100, "wait_timeout_s": 60}  # steps 1, 2: memory only
    ranks = two_ranks(options)
    for step in (1, 2):
        ray.get([a.save.remote(step) for a in ranks])
    kill_actors(ranks)
    lost = []
    for path in shm.list_segments("/dev/shm", shm.job_prefix(two_ranks.job)):
        if shm.tmp_owner(path) is not None:
            # a buffer a killed rank was still laying out in the background (its temp
            # file, header not yet written): not a save; hygiene removes it
            continue
        seg = shm.Segment.attach(path)
        h = seg.read_header()
        seg.close()
        if (h.rank, h.step) == (1, 2):
            os.unlink(path)
            lost.append(path)
    assert len(lost) == 1
    loads = ray.get([a.load.remote() for a in two_ranks(options)], timeout=180)
    # rank 0 still holds step 2, rank 1 only step 1: both restore step 1
    assert [(x["step"], x["source"], x["exact"]) for x in loads] == [
        (1, "memory", True), (1, "memory", True)]


@pytest.mark.slow  # two incarnations: ~14 s
def test_a_restarted_incarnation_without_a_group_never_commits_the_old_shards(two_ranks):
    """Item 1 without a process group: every load draws a new attempt, shared by the
    ranks through the gather board. The first incarnation's rank 1 had written its shard
    of step 5 (its node then died with rank 0's part unwritten: injected with
    ``write_shard`` under that incarnation's attempt and a higher sequence number); the
    second incarnation, same run and world size, reaches step 5 again and commits its
    own two shards only."""
    ckpt = two_ranks.ckpt
    options = {"persist_every_steps": 1, "wait_timeout_s": 60}
    first = two_ranks(options)
    assert [x["step"] for x in ray.get([a.load.remote() for a in first], timeout=180)] \
        == [None, None]
    old = ray.get([a.attempt.remote() for a in first])
    assert old[0] == old[1] and old[0]["epoch"]
    kill_actors(first)
    data_name = storage.rank_files(1)[0]
    stale = storage.write_shard(ckpt, 5, 1, 2, b"stale meta" + storage.attempt_trailer(
        old[1]), memoryview(b"stale"), extra={"seq": 10**6}, attempt=old[1])

    again = two_ranks(options)
    assert [x["step"] for x in ray.get([a.load.remote() for a in again], timeout=180)] \
        == [None, None]
    new = ray.get([a.attempt.remote() for a in again])
    assert new[0] == new[1]
    assert storage.attempt_tag(new[1]) != storage.attempt_tag(old[1])
    ray.get([a.save.remote(5) for a in again])
    ray.get([a.wait.remote() for a in again], timeout=180)
    step_dir = os.path.join(ckpt, "step_00000005")
    manifest = storage.read_manifest(step_dir)
    assert manifest["attempt"] == new[0]
    assert manifest["files"][data_name]["bytes"] != len(b"stale")
    assert manifest["files"][data_name]["crc32"] != stale["files"][data_name]["crc32"]
    storage.verify_step(step_dir)


def test_ranks_that_cannot_gather_draw_attempts_of_their_own(tmp_path):
    """Item 1, the fallback: a process not connected to Ray (the gather fails at once)
    keeps the epoch it drew, so rank 0, rank 1 and a later incarnation of rank 1 all
    name different attempts and no set of their shards is one attempt's."""
    script = textwrap.dedent(f"""
        import json
        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver
        out = []
        for rank in (0, 1, 1):
            s = FlashSaver(SaverConfig(dir={str(tmp_path / "ckpt")!r}, keep=1, job="nogather",
                                       options={{"shm_dir": {str(tmp_path)!r}}}),
                           SaverContext(rank=rank, world_size=2, role="trainer"))
            s.attempts.agree(None)
            out.append(s.attempts.next[0])
            s.close()
        print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert run.returncode == 0, run.stderr
    attempts = json.loads(run.stdout.strip().splitlines()[-1])
    assert len({storage.attempt_tag(a) for a in attempts}) == 3
    assert all(a["epoch"] and a["world_size"] == 2 for a in attempts)
    assert "could not agree on an attempt" in run.stderr
