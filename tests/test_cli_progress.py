"""Seeing progress (issue 29, item 4): plain progress lines when stderr is not a
terminal; ``--verbose`` worker lines labelled by role and rank, every rank's, no colour;
Ray's token-authentication notice said once by us, authentication kept on."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import uuid

import pytest
import yaml
from rich.console import Console

from dlrover_core.cli.main import main
from dlrover_core.cli.progress import JobProgress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _st(step: int, state: str = "running") -> dict:
    return {"name": "ng", "total_steps": 100, "step": step, "state": state,
            "metrics": {"loss": 2.5 - step / 100}, "restarts": {"total": 0}}


def test_plain_lines_when_stderr_is_not_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None)
    with JobProgress(console=console, interval_s=3600) as bar:
        bar.update(_st(-1, "placing"))
        bar.update(_st(9))   # a new state: printed
        bar.update(_st(19))  # same state, within the interval: kept for the end
        bar.update(_st(29))
    lines = buf.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "ng: placing step 0/100", "ng: running step 10/100", "ng: running step 30/100"]
    assert "loss 2.210" in lines[-1] and "\x1b[" not in buf.getvalue()


def test_the_final_line_once_and_with_the_summarys_status():
    """Issue 52 item 8: the end was printed twice (the state change, then the same line
    kept for the end), and an already complete run said ``succeeded``."""
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None)
    with JobProgress(console=console, interval_s=3600) as bar:
        bar.update(_st(99))
        bar.update(_st(99, "succeeded"))  # a new state: printed
        bar.update(_st(99, "succeeded"))  # the same, polled until the summary is there
        done = {**_st(99, "succeeded"), "summary": {"status": "already_complete"}}
        bar.update(done)
    lines = [ln.split(" | ")[0] for ln in buf.getvalue().splitlines()]
    assert lines == ["ng: running step 100/100", "ng: succeeded step 100/100",
                     "ng: already_complete step 100/100"], lines


def test_plain_lines_every_interval():
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None)
    with JobProgress(console=console, interval_s=0) as bar:
        for step in range(3):
            bar.update(_st(step))
    assert len(buf.getvalue().splitlines()) == 3


def test_no_plain_lines_with_no_progress():
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False, color_system=None)
    with JobProgress(enabled=False, console=console, interval_s=0) as bar:
        bar.update(_st(3))
    assert buf.getvalue() == ""


def test_verbose_labels_every_rank(ray_cluster, tmp_path, capfd):
    """A real 2-rank DDP job (tests.cli_workloads:Chatty prints each step)."""
    name = f"verbose-{uuid.uuid4().hex[:6]}"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(
        {"name": name, "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty",
                                             "total": 2, "backend": "ddp",
                                             "resources": {"cpu": 1}}},
         "config": {"max_steps": 3, "step_s": 0.05}}))
    assert main(["submit", str(job), "-v", "--no-progress", "--json",
                 "--job-dir", str(tmp_path / "jd")]) == 0
    err = capfd.readouterr().err
    for rank in (0, 1):  # both ranks' identical-looking lines, none de-duplicated
        for step in range(3):
            assert f"[trainer-{rank} a0] rank {rank} step {step} loss" in err, err[-2000:]
    assert "pid=" not in err and "\x1b[" not in err


def test_token_notice_once_and_authentication_on(tmp_path, monkeypatch):
    """A new local cluster (its own process and HOME): our note instead of Ray's,
    token mode on; a second command says nothing."""
    code = ("import os, tempfile, ray\n"
            "from dlrover_core.master.client import init_ray\n"
            "init_ray(None, num_cpus=1, _temp_dir=tempfile.mkdtemp(prefix='dlr'))\n"
            "print(os.environ['RAY_AUTH_MODE'])\n"
            "ray.shutdown()\n")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": ROOT}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["token"]
    assert run.stderr.count("token authentication") == 1, run.stderr
    assert "Token authentication is enabled for this Ray cluster" not in run.stderr
    assert (tmp_path / ".ray" / "auth_token").exists()  # Ray made the cluster's token
    from dlrover_core.master import ray_auth

    monkeypatch.setenv("HOME", str(tmp_path))
    buf = io.StringIO()
    assert ray_auth.notice_once(buf) is False and buf.getvalue() == ""


@pytest.mark.slow  # a failure and its recovery: ~7 s
def test_the_console_explains_a_failure_and_its_recovery(ray_cluster, tmp_path, capfd):
    """Issue 52 item 3: the console says which rank failed, where and why, and how it was
    recovered, from the run's events (it showed only Ray's raylet text, in colour codes
    when not a terminal). A real 2-rank DDP job whose rank 1 raises during step 2."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(
        {"name": f"explain-{uuid.uuid4().hex[:6]}",
         "roles": {"trainer": {"workload": "tests.cli_workloads:FlakyChatty", "total": 2,
                               "backend": "ddp", "resources": {"cpu": 0.5}}},
         "failover": {"standby": False},
         "checkpoint": {"saver": "disk", "every_steps": 1},
         "node_health": {"skip_node_check": True},
         "config": {"max_steps": 4, "step_s": 0.05, "fail_rank": 1, "fail_step": 2}}))
    assert main(["submit", str(job), "--no-progress", "--json",
                 "--job-dir", str(tmp_path / "jd")]) == 0
    err = capfd.readouterr().err
    assert "trainer-1 failed after step 1: RuntimeError: flaky rank 1 during step 2" in err, err
    assert "recovering at " in err and "recovered in " in err, err
    assert err.index("failed") < err.index("recovering at ") < err.index("recovered in ")
    assert "\x1b[" not in err
    # diagnose names the failure, its classification and the tail of the rank's log
    assert main(["diagnose", str(tmp_path / "jd")]) == 0
    out = capfd.readouterr().out
    assert "run 1: succeeded after 4 steps" in out, out
    assert ("trainer-1 attempt 0 failed after step 1 (run): RuntimeError: flaky rank 1 "
            "during step 2") in out, out
    assert "classified process by builtin" in out and "restarted at process level" in out
    log = str(tmp_path / "jd" / "logs" / "trainer-1" / "attempt-0.log")
    assert f"last lines of {log}:" in out, out
    tail = out.split(f"last lines of {log}:")[1]
    assert "rank 1 step 1 loss" in tail, out  # the rank's own output, up to its failure
