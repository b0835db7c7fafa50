"""Whole jobs under a JobMaster from a test (this process connected to Ray): running one
to its end (:func:`run_job`), waiting for a status (:func:`poll_status`), killing one of
its processes from outside mid-run as failover tests do (:func:`run_killing`), and where
its master ran (:func:`master_node_id`). Re-exported by :mod:`dlrover_core.testing`."""

from __future__ import annotations

import os
import signal
from typing import Any, Callable


def poll_status(master, until: Callable[[dict], bool], timeout: float = 240,
                interval: float = 0.1) -> dict:
    """Poll ``master.status()`` until ``until(status)`` holds; returns that status.
    A master that is restarting (``RayActorError``) is waited for.

    Raises:
        TimeoutError: ``until`` did not hold within ``timeout`` s.
    """
    import time

    import ray

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = ray.get(master.status.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(interval)
            continue
        if until(st):
            return st
        time.sleep(interval)
    raise TimeoutError(f"the job's status did not reach the condition within {timeout} s")


def run_job(spec: Any, job_dir: str, on_status: Callable[[dict], Any] | None = None,
            timeout: float = 240, interval: float = 0.1) -> dict | None:
    """Run a loaded job spec (``load_spec(...)``, ``DLJob.spec``) under a new JobMaster
    in ``job_dir`` (this process must be connected to Ray) and wait for the job to end,
    calling ``on_status(status)`` with each ``master.status()`` polled, every
    ``interval`` s. A job still running after ``timeout`` s is stopped (its summary then
    has status ``stopped``). The master is killed before this returns.

    Returns:
        the job's summary (``status``, ``error``, ``metrics``, ...); ``None`` when a
        stopped job had not ended 60 s later.
    """
    import ray

    from dlrover_core.master.client import create_master

    def done(st: dict) -> bool:
        if on_status is not None:
            on_status(st)
        return bool(st["summary"])

    master = create_master(spec, job_dir)
    try:
        ray.get(master.start.remote())
        try:
            return poll_status(master, done, timeout, interval)["summary"]
        except TimeoutError:
            ray.get(master.stop.remote())
            return ray.get(master.wait.remote(60))
    finally:
        ray.kill(master, no_restart=True)


def master_node_id(job_dir: str) -> str | None:
    """The Ray node id (hex) the JobMaster of ``job_dir`` runs on, from the
    ``job_started`` event of its ``events.jsonl``; ``None`` before that event."""
    from dlrover_core.master.events import read_events

    for e in read_events(os.path.join(job_dir, "events.jsonl")):
        if e["event"] == "job_started":
            return e.get("master_node_id")
    return None


def run_killing(spec: Any, job_dir: str, kill: str | None = None, at_step: int = 0,
                before_step: int | None = None, poll_s: float = 240,
                wait_s: float = 300) -> tuple[dict, dict | None]:
    """Run a loaded job spec (``load_spec(...)``, ``DLJob.spec``) under a new JobMaster
    in ``job_dir`` (this process must be connected to Ray) and wait for the job to end.
    With ``kill`` (an instance label as ``master.status()`` names it: ``trainer-0``,
    ``driver``), SIGKILL that instance's process once the job is running and its driver
    reported step ``at_step`` (the status polled every 20 ms, at most ``poll_s`` s).
    The master is killed before this returns.

    Args:
        before_step: the run must not have reached this step when the kill lands (a
            kill after the last step tests nothing); ``None``: no bound.
        wait_s: how long the job may take after the kill (or, without one, in all), s.

    Returns:
        ``(summary, status)``: the job's summary and the status the kill was decided on
        (its ``instances`` give the pids then); ``status`` is ``None`` without ``kill``.

    Raises:
        AssertionError: the job did not succeed (its error in the message), the run had
            reached ``before_step``, or ``kill`` had no pid.
        TimeoutError: step ``at_step`` was not reached within ``poll_s`` s.
    """
    import ray

    from dlrover_core.master.client import create_master

    master = create_master(spec, job_dir)
    st = None
    ray.get(master.start.remote())
    try:
        if kill is not None:
            st = poll_status(master, lambda s: s["state"] == "running"
                             and s["step"] >= at_step, timeout=poll_s, interval=0.02)
            assert before_step is None or st["step"] < before_step, \
                f"the run reached step {st['step']} before the kill"
            pid = st["instances"][kill]["pid"]
            assert pid, st["instances"]
            os.kill(pid, signal.SIGKILL)
        summary = ray.get(master.wait.remote(wait_s))
    finally:
        ray.kill(master)
    assert summary["status"] == "succeeded", summary["error"]
    return summary, st
