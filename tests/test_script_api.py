"""``dlrover_core.script_api`` from a plain torchrun script run as a script role (real
local Ray, 2 ranks in a real gloo group): the script's ``report_step`` calls reach
``metrics.jsonl``, the summary's step and goodput, and ``dlrover timeline`` (steps,
goodput); its ``report_checkpoint`` calls are ``checkpoint_saved`` events. Outside
dlrover the calls are no-ops (one warning for ``report_step``)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import pytest

from dlrover_core import DLJobBuilder, script_api
from tests.script_jobs import run_two_ranks

STEPS, EVERY = 12, 4

SCRIPT = '''
import os, sys, time

import torch
import torch.distributed as dist

from dlrover_core.script_api import measure_comm_wait, report_checkpoint, report_step

STEPS, EVERY = %d, %d


def main():
    dist.init_process_group("gloo")  # env:// from the role's torchrun variables
    rank = dist.get_rank()
    model = measure_comm_wait(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1)))
    for step in range(STEPS):
        t = torch.tensor([float(step + rank)])
        dist.all_reduce(t)
        time.sleep(0.05)
        if rank == 1:  # late for every gradient all-reduce: rank 0 waits for it
            time.sleep(0.1)
        model(torch.ones(2, 4)).sum().backward()
        assert report_step(step, samples=8, loss=t.item()) is True
        if step == 0:  # the first call only starts the join (a thread imports ray)
            is_initialized = getattr(sys.modules.get("ray"), "is_initialized", None)
            with open("joined-at-first-report-%%d" %% rank, "w") as f:
                f.write(str(is_initialized is not None and is_initialized()))
        if rank == 0 and (step + 1) %% EVERY == 0:
            assert report_checkpoint(step + 1, 0.01) is True
    dist.barrier()
    dist.destroy_process_group()
    return 0
''' % (STEPS, EVERY)


def _outside(monkeypatch) -> None:
    for key in script_api.SCRIPT_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(script_api._Steps, "warned", False)


def test_outside_dlrover_report_step_warns_once_and_does_nothing(monkeypatch):
    _outside(monkeypatch)
    monkeypatch.setenv("RANK", "0")  # plain torchrun: RANK set, no dlrover job
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert script_api.report_step(0, samples=4, loss=1.0) is False
        assert script_api.report_step(1) is False
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert "RAY_ADDRESS, DLROVER_JOB, DLROVER_ROLE not set" in str(caught[0].message)
    assert script_api.report_checkpoint(4) is False
    assert script_api.report_checkpoint_loaded(4, "disk") is False
    with pytest.raises(script_api.NotInDlroverError, match="report_step: RAY_ADDRESS"):
        script_api.script_master("report_step")


def test_a_failed_join_is_raised_by_the_next_report(ray_cluster, monkeypatch):
    """A script role's environment whose job has no JobMaster in the cluster: the first
    ``report_step`` returns at once (the join runs in the background) and, once the
    join has failed, the next call raises ``NotInDlroverError`` naming the job."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    monkeypatch.setenv("DLROVER_JOB", "no-such-job")
    monkeypatch.setenv("DLROVER_ROLE", "trainer")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(script_api._Steps, "reporter", None)
    monkeypatch.setattr(script_api._Steps, "joiner", None)
    assert script_api.report_step(0, samples=1) is True
    assert script_api._Steps.joiner.joined.wait(60)
    with pytest.raises(script_api.NotInDlroverError,
                       match="no JobMaster of job DLROVER_JOB='no-such-job'"):
        script_api.report_step(1)


def _recording_master(job: str, report_s: float = 0.0):
    """An actor under the JobMaster's name of ``job`` that records the step reports
    (``("report", step)``, each taking ``report_s`` s) and checkpoint reports
    (``("checkpoint", step)``, each taking its ``seconds`` s; ``("loaded", step)``) it gets, in the order they arrive; ``seen()`` returns
    them. Threaded (max_concurrency 8), as the JobMaster: calls may overlap."""
    import time

    import ray

    from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

    @ray.remote(max_concurrency=8)
    class Recorder:
        def __init__(self) -> None:
            self.calls: list = []

        def report(self, role, rank, step, metrics, ts) -> None:
            self.calls.append(("report", step))
            time.sleep(report_s)

        def checkpoint_saved(self, role, rank, step, seconds) -> None:
            time.sleep(seconds)  # a slow call: a report sent after it must not overtake it
            self.calls.append(("checkpoint", step))

        def checkpoint_loaded(self, role, rank, step, source, path, attempt) -> None:
            self.calls.append(("loaded", step))

        def seen(self) -> list:
            return self.calls

    master = Recorder.options(name=master_actor_name(job), namespace=MASTER_NAMESPACE).remote()
    ray.get(master.seen.remote())
    return master


def test_a_checkpoint_report_goes_after_the_step_reports_that_wait_for_the_join(
        ray_cluster, monkeypatch):
    """Step reports made before ``report_step``'s background join ends go one by one
    once it is joined; a ``report_checkpoint`` made meanwhile reaches the master after
    them. An elastic role grows at a checkpoint, ending the process: a checkpoint report
    that overtook them lost the reports still waiting (steps 12-19 of
    ``tests/test_script_grow.py``'s 1-rank process, once in CI). The JobMaster here is
    an actor under the master's name that records the order its calls arrive in, each
    step report taking 0.1 s (the order is what is tested, not what a master does);
    the join is held back (the lock it looks the master up under) while the steps are
    reported, as a join that takes seconds on a busy machine."""
    import signal
    import time

    import ray

    master = _recording_master("order-job", report_s=0.1)
    sigterm = signal.getsignal(signal.SIGTERM)  # report_step sets its own until joined
    try:
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        monkeypatch.setenv("DLROVER_JOB", "order-job")
        monkeypatch.setenv("DLROVER_ROLE", "trainer")
        monkeypatch.setenv("RANK", "0")
        for attr in ("reporter", "joiner", "last_ts"):
            monkeypatch.setattr(script_api._Steps, attr, None)
        with script_api._lock:  # a slow join: it waits here while the reports are made
            for step in range(6):
                assert script_api.report_step(step, samples=1) is True
        assert script_api.report_checkpoint(6) is True
        expected = [("report", s) for s in range(6)] + [("checkpoint", 6)]
        deadline = time.monotonic() + 30
        while len(seen := ray.get(master.seen.remote())) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == expected
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        ray.kill(master)


SIGTERMED = """
import os, signal, threading, time

from dlrover_core import script_api

script_api.SIGTERM_FLUSH_S = 60.0  # the bound is not what is tested: a loaded machine
script_api._lock.acquire()  # the join looks the master up under it: held back here
for step in range(5):
    assert script_api.report_step(step, samples=1) is True
threading.Timer(0.5, script_api._lock.release).start()  # a join that takes a while
os.kill(os.getpid(), signal.SIGTERM)  # stopped (as ScriptHost.stop_script does)
time.sleep(120)
raise SystemExit("not ended by the SIGTERM")
"""

JOINED = """
import signal, time

from dlrover_core import script_api

script_api.report_step(0, samples=1)
assert signal.getsignal(signal.SIGTERM) is script_api._on_sigterm
assert script_api._Steps.joiner.joined.wait(60)
script_api.report_step(1, samples=1)  # the first call after the join: the default again
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
print("default again")
"""


def _run_script(tmp_path, name: str, text: str, job: str):
    """Run ``text`` as a script of rank 0 of role ``trainer`` of ``job`` on the test's
    Ray cluster (the environment a script role gives); returns the finished process."""
    import subprocess
    import sys

    import ray

    (tmp_path / name).write_text(text)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "DLROVER_JOB": job, "DLROVER_ROLE": "trainer", "RANK": "0"}
    return subprocess.run([sys.executable, str(tmp_path / name)], env=env,
                          capture_output=True, text=True, timeout=180)


def test_a_sigterm_lets_the_reports_waiting_for_the_join_go_first(ray_cluster, tmp_path):
    """A script stopped with SIGTERM (an elastic re-form, a failover) while its step
    reports still wait for ``report_step``'s background join: they reach the master
    before the process ends, and it still ends as SIGTERM ends it (status -15). Python's
    default SIGTERM ended it at once and lost them (steps 0-9 of
    ``tests/scenarios/script_grow.py``, once in CI). The master is an actor under the
    master's name that records the reports it gets. Once joined, SIGTERM has Python's
    default action again."""
    import time

    import ray

    master = _recording_master("sigterm-job")
    try:
        proc = _run_script(tmp_path, "stopped.py", SIGTERMED, "sigterm-job")
        assert proc.returncode == -15, proc.stderr[-3000:]
        deadline = time.monotonic() + 30
        while len(seen := ray.get(master.seen.remote())) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == [("report", s) for s in range(5)], proc.stderr[-3000:]
        # once joined, SIGTERM has Python's default again (a handler would wait for the
        # main thread, which may be blocked in a collective with a dead peer)
        proc = _run_script(tmp_path, "joined.py", JOINED, "sigterm-job")
        assert proc.returncode == 0 and "default again" in proc.stdout, proc.stderr[-3000:]
    finally:
        ray.kill(master)


CHECKPOINTS_AT_EXIT = """
from dlrover_core import script_api

assert script_api.report_checkpoint_loaded(5, "disk") is True
assert script_api.report_checkpoint(10, 0.5) is True   # the master takes 0.5 s for it
assert script_api.report_checkpoint(20) is True
assert script_api.report_checkpoint(30) is True
# and the script ends at once
"""


def test_checkpoint_reports_arrive_in_order_even_when_the_script_ends_at_once(
        ray_cluster, tmp_path):
    """A script that saves checkpoints and ends right after (the last save a few
    milliseconds before its end, as examples/torchrun_flashckpt/train.py): every report
    reaches the master, in the order made, although the master (threaded, as the
    JobMaster) takes 0.5 s for the first. Sent fire-and-forget they could be lost at the
    exit or overtake each other (``checkpoint_saved`` of step 10 after 20: the summary's
    ``checkpoint_steps`` went back; plugins/flashckpt test_flash_script_reports, once in
    CI)."""
    import ray

    master = _recording_master("ckpt-exit-job")
    try:
        proc = _run_script(tmp_path, "ends.py", CHECKPOINTS_AT_EXIT, "ckpt-exit-job")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ray.get(master.seen.remote()) == [
            ("loaded", 5), ("checkpoint", 10), ("checkpoint", 20), ("checkpoint", 30)]
    finally:
        ray.kill(master)


def test_bad_input_is_named(monkeypatch):
    _outside(monkeypatch)
    with pytest.raises(ValueError, match=r"step=-1.*integer >= 0"):
        script_api.report_step(-1)
    with pytest.raises(ValueError, match=r"samples=2.5"):
        script_api.report_step(1, samples=2.5)
    with pytest.raises(TypeError, match=r"loss='x'"):
        script_api.report_step(1, loss="x")
    with pytest.raises(ValueError, match=r"report_checkpoint\(step='3'\)"):
        script_api.report_checkpoint("3")


def test_shard_sampler_shares_the_master_lookup():
    from dlrover_core.runtime import sharding

    assert sharding.NotInDlroverError is script_api.NotInDlroverError
    assert sharding.SCRIPT_ENV == script_api.SCRIPT_ENV


@pytest.mark.slow  # a script job with its timeline: ~13 s
def test_script_role_steps_reach_metrics_summary_and_timeline(ray_cluster, tmp_path,
                                                               monkeypatch):
    from dlrover_core.cli.job_files import JobFiles
    from dlrover_core.cli.main import main
    from dlrover_core.cli.timeline_model import build_timeline

    summary = run_two_ranks(tmp_path, monkeypatch, "script-steps", "steps_script.py", SCRIPT,
                            "steps_script:main")
    job_dir = str(tmp_path / "job")
    assert summary["steps"] == STEPS and summary["last_step"] == STEPS - 1
    # report_step did not block its caller on the join (ray.init + the master's lookup)
    for rank in (0, 1):
        assert (tmp_path / f"joined-at-first-report-{rank}").read_text() == "False"
    assert summary["metrics"]["loss"] == 2 * (STEPS - 1) + 1  # rank 0's last all-reduce
    assert summary["metrics"]["samples"] == 8.0 and summary["metrics"]["samples_per_s"] > 0
    assert summary["goodput"] is not None and 0 < summary["goodput"] <= 1
    assert summary["checkpoint_steps"] == {"trainer": STEPS}
    files = JobFiles.read(job_dir)
    assert [(s["role"], s["step"]) for s in files.steps] == [
        ("trainer", k) for k in range(STEPS)]  # rank 0's reports, each once
    # measure_comm_wait: rank 0's reports carry its wait for the late rank 1 and its
    # own compute, although the script times nothing (a process's first report: none)
    waits = sorted(s["comm_wait_s"] for s in files.steps[1:])
    assert all("compute_s" in s and "step_s" in s for s in files.steps[1:])
    assert waits[len(waits) // 2] > 0.05, waits
    saved = [e["step"] for e in files.all("checkpoint_saved")]
    assert saved == list(range(EVERY, STEPS + 1, EVERY))
    tl = build_timeline(files)
    assert tl.script_roles == ["trainer"]
    assert [s for _, s in tl.steps] == list(range(STEPS))
    assert [c.step for c in tl.checkpoints] == saved
    assert tl.goodput == summary["goodput"] and tl.breakdown["productive"] > 0
    out = tmp_path / "timeline.json"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert main(["timeline", "script-steps", "--job-dir", job_dir, "--json"]) == 0
    assert [s for _, s in json.loads(out.read_text())["steps"]] == list(range(STEPS))


HANGS_ONCE = '''
import os, time

import torch
import torch.distributed as dist

from dlrover_core.script_api import report_step

MARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hung-once")


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(8):
        t = torch.ones(1)
        dist.all_reduce(t)
        report_step(step, samples=4)
        time.sleep(0.1)
        if step == 3 and rank == 1 and not os.path.exists(MARK):
            open(MARK, "w").close()
            time.sleep(3600)   # hangs after its step-3 report, in the first attempt only
    dist.barrier()
    dist.destroy_process_group()
    return 0
'''

SILENT = '''
import time


def main():
    time.sleep(%g)   # reports no step, for three hang timeouts
    return 0
'''


QUICK = '''
import sys, time

from dlrover_core.script_api import report_step

STEPS = 200


def main():
    for step in range(STEPS):
        report_step(step, samples=1)
    # end once the join's thread has connected to Ray (Ray's import registered its atexit
    # shutdown before that), while it still sends the reports made meanwhile
    ray = None
    while ray is None or not ray.is_initialized():
        ray = getattr(sys.modules.get("ray"), "is_initialized", None) and sys.modules["ray"]
        time.sleep(0.001)
    return 0
'''


def test_a_script_that_ends_before_its_join_still_delivers_its_reports(ray_cluster, tmp_path,
                                                                     monkeypatch):
    """A script whose reports all come before ``report_step``'s background join ends:
    at exit it waits for the join and sends them, before Ray's own exit handler shuts
    Ray down (a Ray call after that ended the script with exit code 1)."""
    from dlrover_core.cli.job_files import JobFiles

    monkeypatch.chdir(tmp_path)
    (tmp_path / "quick.py").write_text(QUICK)
    job_dir = str(tmp_path / "job")
    job = (DLJobBuilder().name("script-quick").train("quick:main").nnodes(1)
           .nproc_per_node(2).resource(cpu=0.5).failover(max_restarts=0).build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert [s["step"] for s in JobFiles.read(job_dir).steps] == list(range(200))
    assert summary["last_step"] == 199


@pytest.mark.slow
def test_a_script_that_reported_steps_and_stops_is_a_hang_a_silent_one_is_not(
        ray_cluster, tmp_path, monkeypatch):
    """``failover.hang_timeout_s`` with a script role: a rank that reported steps and
    then went quiet is a hang (the role restarts and the job succeeds); a plain script
    that reports nothing for three timeouts is left alone."""
    from dlrover_core.master.events import read_events

    monkeypatch.chdir(tmp_path)
    hang_s = 3.0
    (tmp_path / "hangs_once.py").write_text(HANGS_ONCE)
    (tmp_path / "silent.py").write_text(SILENT % (3 * hang_s))

    def run(name: str, command: str) -> tuple[dict, list[dict]]:
        job_dir = str(tmp_path / name)
        job = (DLJobBuilder().name(name).train(command).nnodes(1).nproc_per_node(2)
               .resource(cpu=0.5).failover(hang_timeout_s=hang_s, max_restarts=2).build())
        summary = job.submit(job_dir=job_dir)
        return summary, read_events(os.path.join(job_dir, "events.jsonl"))

    summary, events = run("script-hang", "hangs_once:main")
    assert summary["status"] == "succeeded", summary["error"]
    failed = [e for e in events if e["event"] == "instance_failed"]
    t0 = events[0]["ts"]
    story = [(round(e["ts"] - t0, 2), e["event"], e.get("rank"), e.get("attempt"),
              str(e.get("message", ""))[:160]) for e in events]
    assert [e["kind"] for e in failed] == ["hang"], story
    assert "no step report for" in failed[0]["message"]
    assert summary["restarts"]["total"] == 1 and summary["steps"] == 8
    assert (tmp_path / "hung-once").exists()

    summary, events = run("script-silent", "silent:main")
    assert summary["status"] == "succeeded", summary["error"]
    assert not [e for e in events if e["event"] == "instance_failed"]
    assert summary["restarts"]["total"] == 0
