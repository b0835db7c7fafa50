"""The persister's failure paths with a real FlashPersister (its own threads, no Ray):
a persister SIGKILLed at a crash point of the commit (in a child process), a full
target (a real 1 MiB tmpfs), ENOSPC and EIO at every write of the commit; afterwards
the commit lands, nothing is left behind and the status said what failed."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
from persist_scenario import ROLE, make_slot, persister, stop, wait_for
from test_flash_commit import small_tmpfs  # noqa: F401 - a fixture

from dlrover_core import crashpoints
from dlrover_plugin_flashckpt import storage

SCENARIO = os.path.join(os.path.dirname(__file__), "persist_scenario.py")


def _payload(step: int, rank: int, n: int = 3000) -> bytes:
    return bytes((step * 7 + rank + i) % 251 for i in range(n))


def _data(d: str, step: int, rank: int) -> bytes:
    with open(os.path.join(d, f"step_{step:08d}", f"rank_{rank:05d}.data"), "rb") as f:
        return f.read()


def _locks(d: str) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".commit") or ".commit." in n]


@pytest.fixture
def where(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    return str(shm_dir), str(tmp_path / "ckpt"), f"pf-{uuid.uuid4().hex[:8]}"


def _child(shm_dir, d, job, step, world, point=None, fault="sigkill", nth=1):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLROVER_CRASHPOINT")}
    if point:
        env.update(DLROVER_CRASHPOINT=f"{point}@{nth}", DLROVER_CRASHPOINT_FAULT=fault)
    return subprocess.run([sys.executable, SCENARIO, shm_dir, d, job, str(step), str(world),
                           "20"], env=env, capture_output=True, text=True, timeout=120)


def _two_steps_then_kill(where, point):
    """Step 1 committed by one child persister; step 2 saved, and a second child
    persister SIGKILLed at ``point`` (its first hit: a fresh process)."""
    shm_dir, d, job = where
    segs = [make_slot(shm_dir, job, d, r, 2, 1, _payload(1, r)) for r in range(2)]
    got = _child(shm_dir, d, job, 1, 2)
    assert got.returncode == 0 and got.stdout.split()[-1] == "1", got.stderr[-2000:]
    for r in range(2):
        make_slot(shm_dir, job, d, r, 2, 2, _payload(2, r), seg=segs[r])
    got = _child(shm_dir, d, job, 2, 2, point)
    assert got.returncode == -9, (point, got.returncode, got.stderr[-2000:])
    return segs


# ----------------------------------------------------------------------------- item 5
def test_a_commit_killed_at_the_manifest_write_is_finished_by_the_next_persister(where):
    """The review's reproduction: the persister dies (SIGKILL) at the manifest write of
    step 2, after both ranks' files are written. The slots must not count as
    persisted, and the next persister (no new save) finishes the commit."""
    shm_dir, d, job = where
    segs = _two_steps_then_kill(where, "flash.commit.manifest_write")
    assert storage.lineage_steps(d) == [1]
    assert os.path.exists(os.path.join(storage.tmp_dir(d, 2), storage.INTENT))
    assert all(s.read_header().persisted_seq != s.read_header().seq for s in segs)
    p = persister(shm_dir, job, d, 2)
    try:
        wait_for(lambda: storage.newest_committed(d) == 2, 20, "step 2 committed")
        wait_for(lambda: storage.latest_step(d) == 2, 5, "latest moved to 2")
        storage.verify_step(os.path.join(d, "step_00000002"))
        assert [_data(d, 2, r) for r in range(2)] == [_payload(2, r) for r in range(2)]
        wait_for(lambda: all(s.read_header().persisted_seq == s.read_header().seq
                             for s in segs), 5, "the slots counted as persisted")
        assert not os.path.exists(storage.tmp_dir(d, 2)) and not _locks(d)
    finally:
        stop(p)


def _persist_points():
    return sorted(n for n, p in crashpoints.POINTS.items()
                  if n.startswith(("flash.persist.", "flash.commit.")))


@pytest.mark.parametrize("point", _persist_points())
def test_a_persister_killed_at_any_point_leaves_a_commit_the_next_one_lands(where, point):
    """SIGKILL at each crash point of the persister and the commit, at step 2: step 1
    stays committed and whole; a new persister commits step 2 from the same buffers
    (finishing or redoing the commit), and no lock, temp directory or claim is left."""
    shm_dir, d, job = where
    segs = _two_steps_then_kill(where, point)
    assert storage.verify_step(os.path.join(d, "step_00000001"))["step"] == 1
    assert set(storage.lineage_steps(d)) <= {1, 2}
    p = persister(shm_dir, job, d, 2)
    try:
        wait_for(lambda: storage.newest_committed(d) == 2 and storage.latest_step(d) == 2,
                 20, f"step 2 committed after a kill at {point}")
        storage.verify_step(os.path.join(d, "step_00000002"))
        assert [_data(d, 2, r) for r in range(2)] == [_payload(2, r) for r in range(2)]
        wait_for(lambda: all(s.read_header().persisted_seq == s.read_header().seq
                             for s in segs), 5, "the slots counted as persisted")
        wait_for(lambda: not os.path.exists(storage.tmp_dir(d, 2)) and not _locks(d), 5,
                 f"no temp directory nor lock left: {sorted(os.listdir(d))}")
        assert storage.lineage_steps(d) == [1, 2]
    finally:
        stop(p)


@pytest.mark.parametrize("fault", ["enospc", "eio"])
@pytest.mark.parametrize("point", [n for n in _persist_points()
                                   if crashpoints.POINTS[n].kind == "io"])
def test_a_failed_write_of_the_persist_or_commit_is_retried_until_it_lands(where, point,
                                                                           fault):
    """ENOSPC or EIO raised at each write, fsync and rename of the persist and the
    commit (once), in the real persister loop: the step commits after the backoff, the
    status said what failed and that it recovered, and nothing is left behind."""
    shm_dir, d, job = where
    for r in range(2):
        make_slot(shm_dir, job, d, r, 2, 1, _payload(1, r))
    crashpoints.arm(point, fault)
    p = persister(shm_dir, job, d, 2)
    try:
        wait_for(lambda: storage.newest_committed(d) == 1 and storage.latest_step(d) == 1,
                 20, f"step 1 committed after {fault} at {point}")
        recovered = wait_for(lambda: p.status()["recovered"], 5, "recovered reported")
        assert recovered["tries"] == 1 and os.strerror(getattr(errno, fault.upper())) \
            in recovered["error"]
        assert p.status()["failing"] is None
        assert [_data(d, 1, r) for r in range(2)] == [_payload(1, r) for r in range(2)]
        assert sorted(os.listdir(d)) == ["latest", "step_00000001"]
        assert sorted(os.listdir(os.path.join(d, "step_00000001"))) == [
            "manifest.json", "rank_00000.data", "rank_00000.meta", "rank_00001.data",
            "rank_00001.meta"]
    finally:
        crashpoints.arm(None)
        stop(p)


def test_every_crash_point_of_the_persister_is_reached_by_a_normal_sequence(where, tmp_path):
    shm_dir, d, job = where
    trace = str(tmp_path / "trace")
    crashpoints.arm(None, trace=trace)
    segs = [make_slot(shm_dir, job, d, r, 2, 1, _payload(1, r)) for r in range(2)]
    p = persister(shm_dir, job, d, 2, keep=1)
    try:
        for step in (1, 2):
            if step > 1:
                for r in range(2):
                    make_slot(shm_dir, job, d, r, 2, step, _payload(step, r), seg=segs[r])
            assert p.flush(ROLE, step, timeout=20) == step
        wait_for(lambda: all(s.read_header().persisted_seq == s.read_header().seq
                             for s in segs), 5, "the slots counted as persisted")
    finally:
        crashpoints.arm(None)
        stop(p)
    with open(trace) as f:
        hit = {line.split()[1] for line in f}
    assert set(_persist_points()) - hit == set()
    assert storage.lineage_steps(d) == [2]  # keep=1: step 1 pruned


# ----------------------------------------------------------------------------- item 7
def _fill(where_: str, leave: int) -> str:
    """A file taking all but ``leave`` bytes of the filesystem at ``where_``."""
    filler = os.path.join(where_, "filler")
    st = os.statvfs(where_)
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_full_target_backs_off_leaks_nothing_and_recovers_when_space_returns(
        tmp_path, small_tmpfs, caplog):  # noqa: F811
    """The persist target is full (a real 1 MiB tmpfs): the persister's loop fails the
    write of step 1 with ENOSPC. It backs off (0.5 s, then doubling: not thousands
    of tries a second), removes the partial file of every try, logs the error once, and its
    status says it fails (the error, since when); once space returns the commit lands
    and the status says it recovered."""
    caplog.set_level(logging.INFO)
    shm_dir = str(tmp_path / "shm")
    os.mkdir(shm_dir)
    d, job = os.path.join(small_tmpfs, "ckpt"), f"pf-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    filler = _fill(small_tmpfs, 64 << 10)
    make_slot(shm_dir, job, d, 0, 1, 1, _payload(1, 0, 200 << 10))
    deadline = time.monotonic() + 15
    p = persister(shm_dir, job, d, 1)
    try:
        failing = wait_for(lambda: p.status()["failing"], 10, "the status says it fails")
        assert os.strerror(errno.ENOSPC) in failing["error"] and "step 1" in failing["what"]
        last: dict[int, float] = {}  # try -> when it failed
        while len(last) < 4 or max(last) < 4:
            f = p.status()["failing"]
            last[f["tries"]] = f["last"]
            assert time.monotonic() < deadline, last
            time.sleep(0.02)
        tries = max(last)
        assert tries <= 5, tries  # it spun at thousands of tries a second
        gaps = [last[k + 1] - last[k] for k in (1, 2, 3)]
        assert gaps[0] >= 0.45 and gaps[1] >= 0.95 and gaps[2] >= 1.95, gaps  # doubling
        p.loop.failures.min_s = p.loop.failures.max_s = 3.0  # after the next try, none for 3 s
        wait_for(lambda: p.status()["failing"]["tries"] > tries, 5, "one more try")
        tmp = storage.tmp_dir(d, 1)
        assert not os.path.isdir(tmp) or os.listdir(tmp) == []  # no partial file kept
        status = p.status()
        assert len([e for e in status["errors"] if "No space left" in e]) == 1
        assert status["failing"]["since"] <= status["failing"]["last"]
        assert sum("No space left" in r.getMessage() for r in caplog.records) <= 3
        os.unlink(filler)
        wait_for(lambda: storage.newest_committed(d) == 1, 10, "step 1 committed")  # <= 3 s
        wait_for(lambda: p.status()["failing"] is None, 5, "failing cleared")
        recovered = p.status()["recovered"]
        assert recovered["tries"] >= 3 and "No space left" in recovered["error"]
        assert _data(d, 1, 0) == _payload(1, 0, 200 << 10)
    finally:
        stop(p)


def test_finish_reports_a_step_that_was_not_committed(tmp_path, small_tmpfs):  # noqa: F811
    """The job ends while the target is full: finish() says which step was not
    committed and why (the persist fails with ENOSPC)."""
    shm_dir = str(tmp_path / "shm")
    os.mkdir(shm_dir)
    d, job = os.path.join(small_tmpfs, "ckpt"), f"pf-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    _fill(small_tmpfs, 64 << 10)
    make_slot(shm_dir, job, d, 0, 1, 3, _payload(3, 0, 200 << 10))
    p = persister(shm_dir, job, d, 1)
    report = p.finish(timeout=3)
    assert [(n["role"], n["step"]) for n in report["not_committed"]] == [(ROLE, 3)]
    assert "No space left" in report["not_committed"][0]["reason"]
    assert storage.newest_committed(d) is None
