"""Head loss with Ray's GCS fault tolerance (``dlrover cluster up --gcs-ft``): a
``redis-server`` and a head started with ``RAY_REDIS_ADDRESS``; the head is SIGKILLed
whole and a new head started on the same port with the same Redis
(``local_cluster.restart_head``). A detached actor on the worker node lives through
it: the same process, its state kept, reachable by name through the new head.

A dlrover job lives through it too (``test_job_survives_a_head_restart``): its
JobMaster asks for a sliver of Ray's ``node:__internal_head__`` resource, so Ray
restarts it on the new head, and it re-attaches to the ranks on the worker node.
See docs/clusters.md ("Head loss").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from dlrover_core.cli import local_cluster as lc
from dlrover_core.master.client import read_summary
from dlrover_core.master.events import read_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DLROVER = [sys.executable, "-m", "dlrover_core.cli.main"]
# the tiny model takes 0.03-0.07 s a step here and a head restart about 7 s: the ranks
# train through the restart (steps 5 to PAUSE_AT, 4-10 s), then hold before step
# PAUSE_AT (config.pause) until the test has seen the restarted master re-attach to
# them, and train on to STEPS: the restarted master records steps up to STEPS - 1
# however long the master's restart took
STEPS = 200
PAUSE_AT = 150
TINY = ["config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=1", "config.lr=1e-2",
        "config.warmup_steps=2", "checkpoint.every_steps=20", "placement=spread",
        "node_health.skip_node_check=true"]

ACTOR = r'''
import os, sys
import ray
ray.init(address=sys.argv[1], namespace="gcsft", logging_level="ERROR")

@ray.remote(num_cpus=1)
class Counter:
    def __init__(self):
        self.n = 0

    def inc(self):
        self.n += 1
        return self.n, os.getpid(), ray.get_runtime_context().get_node_id()

if sys.argv[2] == "create":
    c = Counter.options(name="counter", lifetime="detached").remote()
else:
    c = ray.get_actor("counter")
n, pid, node = ray.get(c.inc.remote(), timeout=120)
print(n, pid, node)
'''


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_actor_on_a_worker_node_survives_a_head_restart(tmp_path):
    d = str(tmp_path / "cluster")
    state = lc.up(nodes=1, cpus_per_node=1, directory=d, gcs_ft=True)
    try:
        assert lc.pid_alive(state["redis"]["pid"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(lc.client_env(state))

        def call(mode: str) -> list[str]:
            out = subprocess.run([sys.executable, "-c", ACTOR, state["address"], mode],
                                 env=env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            return out.stdout.split()

        n, pid, node = call("create")
        worker = next(x for x in state["nodes"] if not x["head"])
        assert n == "1" and node == worker["node_id"]
        old_head = next(x for x in state["nodes"] if x["head"])
        new_head = lc.restart_head(state)
        assert not lc.pid_alive(old_head["pid"]) and lc.pid_alive(new_head["pid"])
        assert new_head["node_id"] and new_head["node_id"] != old_head["node_id"]
        assert call("get") == ["2", pid, node]  # same process, state kept
    finally:
        lc.down(d)
    assert not lc.pid_alive(state["redis"]["pid"])


def _steps(job_dir: str) -> list[int]:
    path = os.path.join(job_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r["step"] for r in read_events(path) if r.get("event") == "step"]


def _wait(what: str, cond, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_job_survives_a_head_restart(tmp_path):
    """A job submitted with ``--no-wait``, its ranks on the worker node, the head
    SIGKILLed and restarted mid-run: Ray restarts the JobMaster on the new head (its
    placement asks for the head resource, not the old head's node id), the master
    re-attaches to its run and the job succeeds with a summary."""
    d = str(tmp_path / "cluster")
    job_dir = str(tmp_path / "job")
    go = str(tmp_path / "go")
    state = lc.up(nodes=1, cpus_per_node=2, directory=d, gcs_ft=True)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(lc.client_env(state))
        out = subprocess.run(
            [*DLROVER, "submit", "examples/nanogpt/job.yaml", "name=gcsft", *TINY,
             f"config.max_steps={STEPS}", f"+config.pause={{step: {PAUSE_AT}, until: '{go}'}}",
             "--job-dir", job_dir, "--no-progress",
             "--no-wait", "--address", state["address"]],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        _wait("step 5", lambda: max(_steps(job_dir), default=-1) >= 5, 300)
        old_head = next(x for x in state["nodes"] if x["head"])
        new_head = lc.restart_head(state)
        assert new_head["node_id"] != old_head["node_id"]
        _wait("master_reattached", lambda: any(
            e["event"] == "master_reattached"
            for e in read_events(os.path.join(job_dir, "events.jsonl"))), 420)
        assert read_summary(job_dir) is None and max(_steps(job_dir)) < PAUSE_AT
        open(go, "w").close()
        _wait("summary.json", lambda: read_summary(job_dir) is not None, 420)
        summary = read_summary(job_dir)
        events = read_events(os.path.join(job_dir, "events.jsonl"))
        restarted = [e for e in events if e["event"] == "master_restarted"]
        assert summary["status"] == "succeeded", (summary, events[-20:])
        assert summary["steps"] == STEPS
        assert len(restarted) == 1 and restarted[0]["previous_state"] == "running"
        attached = [e for e in events if e["event"] == "master_reattached"]
        assert [sorted(e["attached"]) for e in attached] == [["trainer-0", "trainer-1"]]
        assert summary["restarts"]["total"] == 0  # re-attached: no rank was restarted
        # the restarted master records the ranks' steps again (those reported while it
        # was down are lost)
        after = [r["step"] for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
                 if r.get("event") == "step" and r["ts"] >= restarted[0]["ts"]]
        assert after and after[-1] == STEPS - 1, after[-5:]
        status = subprocess.run([*DLROVER, "status", "gcsft", "--address", state["address"]],
                                cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=180)
        assert status.returncode == 0 and "succeeded" in status.stdout, status
    finally:
        lc.down(d)
