"""Jobs as Ray Jobs users expect (issue 29, item 7): ``submit --no-wait`` detaches and
says how to follow the job; ``dlrover delete`` removes a finished job's directory and
its flash-checkpoint buffers, and refuses a running one. A detached job (``--no-wait``,
Ctrl-C) keeps its directories locked while it runs (issue 28, item 4): real jobs on the
test's Ray cluster, real second submits in other processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from dlrover_core.cli.main import main
from dlrover_core.master.dir_lock import LOCK_NAME, DirInUseError, DirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPEC = {"roles": {"trainer": {"workload": "tests.cli_workloads:Chatty", "total": 1,
                              "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "every_steps": 2, "keep": 2},
        "config": {"max_steps": 3, "step_s": 0.05}}


def _finished_job_dir(root, name: str) -> str:
    d = root / name
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"run": 1, "name": name, "started_at": 1.0}))
    (d / "summary.json").write_text(json.dumps({"name": name, "status": "succeeded"}))
    (d / "ckpt").mkdir()
    return str(d)


def test_delete_removes_the_directory_and_the_flash_buffers(ray_cluster, tmp_path, capfd,
                                                            monkeypatch):
    from dlrover_plugin_flashckpt import shm

    monkeypatch.chdir(tmp_path)
    name = f"del-{uuid.uuid4().hex[:6]}"
    d = _finished_job_dir(tmp_path / "runs", name)
    path = os.path.join("/dev/shm", shm.slot_name(name, os.path.join(d, "ckpt"), 0, 0))
    shm.Segment.create(path, 100, 100, {"job": name, "dir": os.path.join(d, "ckpt")},
                       bytes(16), 0, 1).close()
    try:
        assert main(["delete", name]) == 0
        out = capfd.readouterr().out
        assert not os.path.exists(d) and not os.path.exists(path)
        assert f"deleted job {name}: {d}" in out
        assert os.path.basename(path) in out
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_delete_refuses_a_running_job(ray_cluster, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = _finished_job_dir(tmp_path / "runs", "busy")
    with DirLock(d, "job directory", "busy"):  # as a running submit holds it
        assert main(["delete", "busy"]) == 3
    err = capfd.readouterr().err
    assert "job 'busy' is running" in err and "dlrover stop busy" in err
    assert os.path.isdir(d)


def test_delete_of_an_unknown_job_is_bad_input(ray_cluster, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["delete", "nothing-here"]) == 2
    assert "nothing-here" in capfd.readouterr().err


def test_no_wait_needs_a_cluster_that_outlives_the_command(tmp_path, capfd):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "nw", **SPEC}))
    assert main(["submit", str(job), "--no-wait"]) == 2
    assert "--no-wait needs a Ray cluster" in capfd.readouterr().err


def test_no_wait_detaches_and_says_how_to_follow(ray_cluster, tmp_path, capfd):
    """A real job on the test's Ray cluster: submit returns at once; the job goes on
    and ends by itself; then delete removes it."""
    import ray

    from dlrover_core.master.client import get_master

    name = f"nw-{uuid.uuid4().hex[:6]}"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": name, **SPEC}))
    job_dir = str(tmp_path / "jd")
    assert main(["submit", str(job), "--no-wait", "--address", "auto",
                 "--job-dir", job_dir]) == 0
    out = capfd.readouterr().out
    assert f"submitted {name} (run 1) in {job_dir}" in out
    assert f"dlrover status {name}" in out and f"dlrover logs {name} -f" in out
    master = get_master(name)
    assert master is not None  # still running, or just done: this process did not wait
    summary = ray.get(master.wait.remote(120))
    assert summary["status"] == "succeeded"
    ray.kill(master, no_restart=True)
    _wait_unlocked(job_dir)  # the lock keeper lets go once it sees the job ended
    assert main(["delete", name, "--job-dir", job_dir]) == 0
    assert not os.path.exists(job_dir)


def _wait_unlocked(directory: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            DirLock(directory, "job directory", "test").acquire().release()
            return
        except DirInUseError:
            assert time.monotonic() < deadline, f"{directory} is still locked"
            time.sleep(0.2)


def _long_job(tmp_path, name: str) -> str:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": name, **SPEC,
                                   "config": {"max_steps": 100000, "step_s": 0.2}}))
    return str(job)


def _keeper_holds(directory: str, name: str, other_than: int) -> int:
    """The pid of the lock keeper holding ``directory`` (checked: a live process that
    is not ``other_than``, recorded as the keeper of job ``name``)."""
    with open(os.path.join(directory, LOCK_NAME)) as f:
        holder = json.load(f)
    assert (holder["job"], holder["by"]) == (name, "the lock keeper of the detached job")
    assert holder["pid"] != other_than
    os.kill(holder["pid"], 0)  # alive
    with pytest.raises(DirInUseError, match=f"in use by pid {holder['pid']} "):
        DirLock(directory, "job directory", "test").acquire()
    return holder["pid"]


def _second_submit_is_refused(job: str, job_dir: str, keeper: int) -> None:
    """A second, real ``dlrover submit`` of the directory exits 3 naming the keeper."""
    second = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "submit", job,
                             "--job-dir", job_dir, "--no-progress"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 3, second.stderr
    assert (f"the job directory {job_dir} is in use by pid {keeper} on "
            f"{socket.gethostname()}") in " ".join(second.stderr.split())


def _stop(name: str) -> None:
    import ray

    from dlrover_core.master.client import get_master

    master = get_master(name)
    ray.get(master.stop.remote())
    assert ray.get(master.wait.remote(120))["status"] == "stopped"
    ray.kill(master, no_restart=True)


def test_a_job_submitted_without_waiting_keeps_its_directories_locked(ray_cluster, tmp_path):
    """Issue 28 item 4: ``--no-wait`` hands the locks over to a lock keeper actor, which
    holds them while the job runs and lets go once it is stopped."""
    name = f"keep-{uuid.uuid4().hex[:6]}"
    job, job_dir = _long_job(tmp_path, name), str(tmp_path / "jd")
    assert main(["submit", job, "--no-wait", "--address", "auto", "--job-dir", job_dir]) == 0
    try:
        keeper = _keeper_holds(job_dir, name, other_than=os.getpid())
        assert _keeper_holds(os.path.join(job_dir, "ckpt"), name, os.getpid()) == keeper
        _second_submit_is_refused(job, job_dir, keeper)
    finally:
        _stop(name)
    _wait_unlocked(job_dir)
    _wait_unlocked(os.path.join(job_dir, "ckpt"))


def _default_sigint() -> None:
    """In the child: SIGINT raises KeyboardInterrupt, as at a terminal. A test run
    started in the background by a non-interactive shell inherits SIGINT ignored, and
    Python then keeps ignoring it (the submit would never see the Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # 11 s: make test's lanes stay under 10 minutes on 2 cores (CI runs it)
def test_a_job_detached_by_ctrl_c_keeps_its_directories_locked(ray_cluster, tmp_path):
    """Issue 28 item 4: a real ``dlrover submit`` joined to the test's cluster, sent
    SIGINT while the job runs, detaches; the job's directories stay locked (by the
    keeper, not by the submit, which has exited) until the job is stopped."""
    import ray

    from dlrover_core.master.client import get_master

    name = f"keepc-{uuid.uuid4().hex[:6]}"
    job, job_dir = _long_job(tmp_path, name), str(tmp_path / "jd")
    address = ray.get_runtime_context().gcs_address
    first = subprocess.Popen([sys.executable, "-m", "dlrover_core.cli.main", "submit", job,
                              "--job-dir", job_dir, "--no-progress", "--address", address],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 180
        while (get_master(name) is None
               or ray.get(get_master(name).status.remote())["state"] != "running"):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=120)
        assert "detached; the job goes on" in err
        assert get_master(name) is not None
        keeper = _keeper_holds(job_dir, name, other_than=first.pid)
        _second_submit_is_refused(job, job_dir, keeper)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
        if get_master(name) is not None:
            _stop(name)
    _wait_unlocked(job_dir)

