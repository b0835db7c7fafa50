"""No step redone: a DDP rank SIGKILLed between two checkpoints is healed from the
survivor's live state (``dlrover_core.checkpoint.heal``), not from the last checkpoint.

A real job (JobMaster, two DDP ranks on gloo, the disk saver every 4 steps) is paused
before step 6, rank 1's process is SIGKILLed, the pause is released: rank 0's step
fails (its all-reduce with the dead peer, or, once the master's abort came, its next
forward: ``dlrover_core.runtime.attempt_stop``), it is set up again in place, and the
replacement takes its model, optimizer, step and random state. The final state of both
ranks must equal an uninterrupted run's bit for bit, and no step may be reported
twice."""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest
import ray
import torch

from dlrover_core import load_spec
from dlrover_core.master.client import create_master
from dlrover_core.master.events import read_events
from dlrover_core.runs import run_paths
from dlrover_core.testing import poll_status, run_job

WORKLOAD = "plugins.fsdp.tests.fsdp_workloads:ReplicaTrainer"
STEPS, PAUSE, EVERY = 12, 6, 4


def spec(name: str, pause_until: str):
    return load_spec({
        "name": name,
        "roles": {"trainer": {"workload": WORKLOAD, "total": 2, "backend": "ddp",
                              "resources": {"cpu": 0.5}}},
        # generous bounds: a busy 2-core machine must not turn the survivor into a
        # replaced rank (then there is nobody to heal from)
        "failover": {"max_restarts": 2, "standby": False, "pg_timeout_s": 60,
                     "survivor_grace_s": 60},
        "checkpoint": {"saver": "disk", "every_steps": EVERY, "keep": 2},
        "node_health": {"skip_node_check": True},
        "config": {"steps": STEPS, "pause_step": PAUSE, "pause_until": pause_until},
    })


def gone(pid: int) -> bool:
    """The process ``pid`` is dead (gone, or a zombie not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def final(job_dir: str, rank: int) -> dict:
    return torch.load(os.path.join(job_dir, f"final-{rank}.pt"), weights_only=False)


def assert_bit_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bit_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("release", ["at_once", "after_abort"])
def test_sigkilled_ddp_rank_heals_from_survivor_with_no_step_redone(ray_cluster, tmp_path,
                                                                     release):
    ref_dir, job_dir = str(tmp_path / "ref"), str(tmp_path / "job")
    os.makedirs(ref_dir)
    os.makedirs(job_dir)
    released = tmp_path / "released"
    released.touch()
    ref = run_job(spec("heal-ref", str(released)), ref_dir, timeout=300)
    assert ref["status"] == "succeeded", ref["error"]

    pause = tmp_path / "pause"
    master = create_master(spec("heal-kill", str(pause)), job_dir)
    try:
        ray.get(master.start.remote())
        # rank 0 reported step PAUSE - 1: both ranks are done with it (its all-reduce
        # needed both) and wait before step PAUSE; the last checkpoint is step 4
        st = poll_status(master, lambda s: s["step"] >= PAUSE - 1 or s["summary"], 300)
        assert not st["summary"], st["summary"]
        pid = st["instances"]["trainer-1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 60
        while not gone(pid) and time.time() < deadline:
            time.sleep(0.05)
        if release == "after_abort":
            # the master's abort reaches the paused survivor first (a few ms after
            # recovery_started; 3 s of margin), so its forward of step PAUSE stops
            deadline = time.time() + 60
            while not [e for e in read_events(run_paths(job_dir).events)
                       if e["event"] == "recovery_started"] and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(3)
        pause.touch()  # rank 0 goes on: its step PAUSE fails
        summary = poll_status(master, lambda s: s["summary"], 300)["summary"]
    finally:
        ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["total"] == 1

    events = read_events(run_paths(job_dir).events)
    started = [e for e in events if e["event"] == "instance_started" and e["attempt"] == 1]
    assert {(e["rank"], e["in_place"]) for e in started} == {(0, True), (1, False)}
    loads = [(e["step"], e["source"]) for e in events if e["event"] == "checkpoint_loaded"]
    assert loads == [(PAUSE, "peer")]  # from the survivor, at the step it had reached
    steps = [r["step"] for r in read_events(run_paths(job_dir).metrics)
             if r["event"] == "step" and r["role"] == "trainer"]
    assert collections.Counter(steps) == collections.Counter(range(STEPS))  # none redone

    if release == "after_abort":   # stopped at its forward, not at the all-reduce
        with open(os.path.join(job_dir, "logs", "trainer-0", "attempt-0.log")) as f:
            assert "attempt ended: AttemptAborted" in f.read()
    for rank in (0, 1):  # model, optimizer, step and random state, bit for bit
        assert_bit_equal(final(job_dir, rank), final(ref_dir, rank), f"rank{rank}")
    assert_bit_equal(final(job_dir, 0)["model"], final(job_dir, 1)["model"], "replicas")
