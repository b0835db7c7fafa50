"""Issue 28 item 4: one run per job directory and per checkpoint folder. A real
``dlrover submit`` (its own embedded Ray cluster) runs; a second real submit of the
same job directory, and one of another job directory with the same checkpoint folder,
exit 3 at once naming the directory and the holder, and the first job is unharmed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from dlrover_core.master.dir_lock import LOCK_NAME, DirInUseError, DirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(name: str, ckpt: str) -> str:
    return json.dumps({
        "name": name,
        "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty", "total": 1,
                              "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "dir": ckpt, "every_steps": 10, "keep": 1},
        "config": {"max_steps": 60, "step_s": 0.1}})


def _submit(spec: str, job_dir: str) -> list[str]:
    return [sys.executable, "-m", "dlrover_core.cli.main", "submit", spec, "--job-dir", job_dir,
            "--no-progress"]


@pytest.mark.slow
def test_second_submit_of_a_directory_in_use_exits_before_touching_it(tmp_path):
    name = f"lock-{uuid.uuid4().hex[:6]}"
    ckpt = str(tmp_path / "ckpt")
    spec = tmp_path / "job.yaml"  # JSON is YAML
    spec.write_text(_spec(name, ckpt))
    job_dir = str(tmp_path / "runs" / name)
    first = subprocess.Popen(_submit(str(spec), job_dir), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lock = os.path.join(job_dir, LOCK_NAME)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(job_dir, "context.sqlite")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first job did not start"
            time.sleep(0.1)
        holder = json.loads(open(lock).read())
        assert (holder["pid"], holder["host"], holder["job"]) == (
            first.pid, socket.gethostname(), name)
        before = os.stat(os.path.join(job_dir, "context.sqlite")).st_ino

        second = subprocess.run(_submit(str(spec), job_dir), cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 3, second.stderr
        msg = " ".join(second.stderr.split())
        assert f"the job directory {job_dir} is in use by pid {first.pid} on " \
               f"{socket.gethostname()}" in msg

        other_dir = str(tmp_path / "runs" / "other")  # another directory, same checkpoints
        third = subprocess.run(_submit(str(spec), other_dir), cwd=ROOT, capture_output=True,
                               text=True, timeout=120)
        assert third.returncode == 3, third.stderr
        assert f"the checkpoint folder {ckpt} is in use by pid {first.pid}" in " ".join(
            third.stderr.split())
        assert os.listdir(other_dir) == [LOCK_NAME]  # nothing else was written there

        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
        assert os.stat(os.path.join(job_dir, "context.sqlite")).st_ino == before
        with open(os.path.join(job_dir, "summary.json")) as f:
            summary = json.load(f)
        assert summary["status"] == "succeeded" and summary["steps"] == 60
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    # the lock went with the run: the directory can be locked again
    with DirLock(job_dir, "job directory", name):
        pass


def test_lock_is_exclusive_between_open_file_descriptions(tmp_path):
    with DirLock(str(tmp_path), "job directory", "a"):
        with pytest.raises(DirInUseError, match=rf"{tmp_path} is in use by pid {os.getpid()}"):
            DirLock(str(tmp_path), "job directory", "b").acquire()
    DirLock(str(tmp_path), "job directory", "b").acquire().release()


def test_a_handed_over_lock_is_only_for_its_token_until_the_deadline(tmp_path, monkeypatch):
    """Issue 28 item 4: the handover to a detached job's lock keeper leaves no gap."""
    from dlrover_core.master import dir_lock

    first = DirLock(str(tmp_path), "job directory", "a").acquire()
    first.release(handover="t0ken")
    with pytest.raises(DirInUseError, match="handing it over to the job's lock keeper"):
        DirLock(str(tmp_path), "job directory", "b").acquire()
    keeper = DirLock(str(tmp_path), "job directory", "a", by="keeper").acquire(token="t0ken")
    with pytest.raises(DirInUseError, match=rf"in use by pid {os.getpid()} .*, keeper\)"):
        DirLock(str(tmp_path), "job directory", "b").acquire()
    keeper.release()
    DirLock(str(tmp_path), "job directory", "b").acquire().release()

    monkeypatch.setattr(dir_lock, "HANDOVER_S", 0.0)  # a keeper that never came
    DirLock(str(tmp_path), "job directory", "a").acquire().release(handover="gone")
    DirLock(str(tmp_path), "job directory", "b").acquire().release()
