"""Issue 28 item 4: one run per job directory and per checkpoint folder. A real
``dlrover submit`` (its own embedded Ray cluster) runs; a second real submit of the
same job directory, and one of another job directory with the same checkpoint folder,
exit 3 at once naming the directory and the holder, and the first job is unharmed.

Issue 49 item 8: a lock file removed or replaced while held lets no second process in
(a real second process tries), and the holder notices (:meth:`DirLock.check`)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import time
import types
import uuid

import pytest

from dlrover_core.master import dir_lock
from dlrover_core.master.dir_lock import (LOCK_NAME, DirInUseError, DirLock, LockKeeper,
                                          LockLostError)

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


_SECOND = """
import sys
from dlrover_core.master.dir_lock import DirInUseError, DirLock
try:
    DirLock(sys.argv[1], "job directory", "second").acquire()
except DirInUseError as exc:
    print(exc)
    sys.exit(3)
print("acquired")
"""


def _acquire_in_another_process(directory: str) -> subprocess.CompletedProcess:
    """A second, real process tries to take the lock of ``directory`` (exit 3 and the
    message when refused, exit 0 and ``acquired`` when it got it)."""
    return subprocess.run([sys.executable, "-c", _SECOND, directory], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_removed_lock_file_lets_no_second_process_in(tmp_path):
    first = DirLock(str(tmp_path), "job directory", "a").acquire()
    try:
        os.unlink(os.path.join(tmp_path, LOCK_NAME))
        second = _acquire_in_another_process(str(tmp_path))
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"the job directory {tmp_path} is in use by another process that holds the " \
               f"directory's lock (its lock file {LOCK_NAME} was removed or replaced" \
            in " ".join(second.stdout.split())
    finally:
        first.release()
    assert "acquired" in _acquire_in_another_process(str(tmp_path)).stdout  # nothing wedged


def test_a_replaced_lock_file_lets_no_second_process_in(tmp_path):
    first = DirLock(str(tmp_path), "job directory", "a").acquire()
    try:
        other = tmp_path / "other"
        other.write_text('{"note": "a file of the user"}')  # not a holder record
        os.replace(other, os.path.join(tmp_path, LOCK_NAME))
        second = _acquire_in_another_process(str(tmp_path))
        assert second.returncode == 3, second.stdout + second.stderr
        assert "was removed or replaced while it held it" in " ".join(second.stdout.split())
    finally:
        first.release()
    assert "acquired" in _acquire_in_another_process(str(tmp_path)).stdout


def test_the_holder_notices_a_removed_or_replaced_lock_file(tmp_path):
    path = os.path.join(tmp_path, LOCK_NAME)
    lock = DirLock(str(tmp_path), "job directory", "a").acquire()
    try:
        lock.check()  # held, nothing changed: no error
        os.unlink(path)
        with pytest.raises(LockLostError, match=rf"the run lock of the job directory "
                                                rf"{tmp_path} is lost: its lock file {path} "
                                                "was removed"):
            lock.check()
        (tmp_path / "other").write_text("[1, 2]")  # JSON, but not a holder record
        os.replace(tmp_path / "other", path)
        with pytest.raises(LockLostError, match=rf"its lock file {path} was replaced"):
            lock.check()
    finally:
        lock.release()
    DirLock(str(tmp_path), "job directory", "b").acquire().release()  # the list: no holder
    lock = DirLock(str(tmp_path / "jd"), "checkpoint folder", "a").acquire()
    try:
        os.rename(tmp_path / "jd", tmp_path / "jd.old")  # the directory itself replaced
        os.mkdir(tmp_path / "jd")
        with pytest.raises(LockLostError, match=rf"checkpoint folder {tmp_path}/jd is lost: "
                                                rf"its directory {tmp_path}/jd was replaced"):
            lock.check()
    finally:
        lock.release()


def test_the_lock_keeper_reports_a_lost_lock_once(tmp_path, caplog):
    keeper = LockKeeper("job-a", "no-master", "no-namespace")  # a plain object: no Ray
    keeper._locks.append(DirLock(str(tmp_path), "job directory", "job-a").acquire())
    try:
        assert keeper.check_locks() == []
        os.unlink(os.path.join(tmp_path, LOCK_NAME))
        with caplog.at_level(logging.ERROR, logger=dir_lock.__name__):
            lost = [str(e) for e in keeper.check_locks() + keeper.check_locks()]
        assert len(lost) == 2 and f"job directory {tmp_path} is lost" in lost[0]
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [f"job job-a: {lost[0]}"]  # logged once, not every round
    finally:
        keeper._release()


def test_a_lock_file_replaced_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    """The race the inode re-check closes: between this process's ``open`` and
    ``flock`` of the lock file, the file is removed and another process (as on another
    NFS host: it locks the new file only, not the directory) creates and locks a new one.
    Locking the orphaned file must not count as holding the lock."""
    path = os.path.join(tmp_path, LOCK_NAME)
    other: list[subprocess.Popen] = []
    hold = ("import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n")

    def flock(fd: int, op: int) -> None:
        if not other:  # the first flock: the lock file's, right after its open
            os.unlink(path)
            other.append(subprocess.Popen([sys.executable, "-c", hold, path],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True))
            assert other[0].stdout.readline() == "held\n"
        fcntl.flock(fd, op)

    monkeypatch.setattr(dir_lock, "fcntl", types.SimpleNamespace(
        flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    try:
        with pytest.raises(DirInUseError, match=rf"{tmp_path} is in use by another process"):
            DirLock(str(tmp_path), "job directory", "b").acquire()
    finally:
        for p in other:
            p.communicate(input="", timeout=30)
