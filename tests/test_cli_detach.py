"""Jobs as Ray Jobs users expect (issue 29, item 7): ``submit --no-wait`` detaches and
says how to follow the job; ``dlrover delete`` removes a finished job's directory and
its flash-checkpoint buffers, and refuses a running one."""

from __future__ import annotations

import json
import os
import uuid

import yaml

from dlrover_core.cli.main import main
from dlrover_core.master.dir_lock import DirLock

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
    assert main(["delete", name, "--job-dir", job_dir]) == 0
    assert not os.path.exists(job_dir)

