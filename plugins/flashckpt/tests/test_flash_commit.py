"""The commit protocol of flash checkpoints on disk (storage.py), without Ray: faults
are injected from outside the code under test (a stale temp folder of another run or
world size, a truncated shard, a short-writing file, a full tmpfs, a stale lock)."""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from dlrover_core.atomic_io import write_all
from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core import crashpoints
from dlrover_plugin_flashckpt import commitlock, shm, storage
from dlrover_plugin_flashckpt.meta import pack_meta, unpack_meta


def _shard(d, step, rank, world, payload, attempt=None, seq=1):
    return storage.write_shard(d, step, rank, world, b"meta%d" % rank, memoryview(payload),
                               extra={"seq": seq}, attempt=attempt)


def _data(d, step, rank=0):
    with open(os.path.join(d, f"step_{step:08d}", f"rank_{rank:05d}.data"), "rb") as f:
        return f.read()


# ----------------------------------------------------------------------------- item 1
def test_markers_of_two_world_sizes_never_make_a_commit(tmp_path):
    """The review's reproduction: rank 0 written for world size 4, rank 1 for 2."""
    d = str(tmp_path)
    _shard(d, 7, 0, 4, b"a" * 64)
    _shard(d, 7, 1, 2, b"b" * 64)
    assert not storage.try_commit(d, 7, 2, keep=2)
    assert storage.newest_committed(d) is None
    assert not os.path.exists(os.path.join(d, "step_00000007"))


def test_markers_of_two_runs_never_make_a_commit(tmp_path):
    d = str(tmp_path)
    _shard(d, 7, 0, 2, b"a" * 64, storage.make_attempt("run-a", 2, "e1"))
    _shard(d, 7, 1, 2, b"b" * 64, storage.make_attempt("run-b", 2, "e1"))
    assert not storage.try_commit(d, 7, 2, keep=2)
    _shard(d, 7, 1, 2, b"c" * 64, storage.make_attempt("run-a", 2, "e1"))
    assert storage.try_commit(d, 7, 2, keep=2)
    manifest = storage.verify_step(os.path.join(d, "step_00000007"))
    assert manifest["attempt"] == storage.make_attempt("run-a", 2, "e1")
    assert _data(d, 7, 1) == b"c" * 64
    # only the committed attempt's files are left, under their plain names
    assert sorted(os.listdir(os.path.join(d, "step_00000007"))) == [
        "manifest.json", "rank_00000.data", "rank_00000.meta", "rank_00001.data",
        "rank_00001.meta"]


@pytest.mark.parametrize("stale", ["other-world", "other-run"])
def test_stale_temp_folder_of_another_attempt_is_not_committed_by_a_new_run(tmp_path, stale):
    """A node died while step 5 was written; the job restarted from step 3 (a new
    lineage) and reaches step 5 again. The stale folder is complete for its own
    attempt, and it is never committed: only the new attempt's files are."""
    d = str(tmp_path)
    old = storage.make_attempt("run-1", 2, "old")
    for r in range(2):
        _shard(d, 3, r, 2, b"3" * 32, old)
    assert storage.try_commit(d, 3, 2, keep=3)
    if stale == "other-world":
        stale_att = storage.make_attempt("run-1", 4, "old")
        for r in range(4):
            _shard(d, 5, r, 4, b"s" * 32, stale_att)
    else:
        stale_att = storage.make_attempt("run-0", 2, "old")
        for r in range(2):
            _shard(d, 5, r, 2, b"s" * 32, stale_att)
    new = storage.make_attempt("run-1", 2, "new")
    storage.start_lineage(d, new, base=3)
    assert not storage.try_commit(d, 5, 2, keep=3)  # the stale attempt: refused
    assert not storage.try_commit(d, 5, 4, keep=3)
    _shard(d, 5, 0, 2, b"n" * 32, new)
    assert not storage.try_commit(d, 5, 2, keep=3)  # rank 1 of the new attempt missing
    _shard(d, 5, 1, 2, b"N" * 32, new)
    assert storage.try_commit(d, 5, 2, keep=3)
    assert storage.verify_step(os.path.join(d, "step_00000005"))["attempt"] == new
    assert (_data(d, 5, 0), _data(d, 5, 1)) == (b"n" * 32, b"N" * 32)
    assert storage.lineage_steps(d) == [3, 5]


def test_a_step_above_the_base_of_another_lineage_no_longer_counts(tmp_path):
    """Steps 4 and 6 were committed; the job explicitly restored step 4 and saves
    step 5: it commits, step 6 (another lineage) is not "newest" any more, and a
    re-save of step 6 by the new lineage replaces it."""
    d = str(tmp_path)
    a = storage.make_attempt("r", 1, "a")
    for step in (4, 6):
        _shard(d, step, 0, 1, b"%d" % step * 8, a)
        assert storage.try_commit(d, step, 1, keep=5)
    b = storage.make_attempt("r", 1, "b")
    storage.start_lineage(d, b, base=4)
    assert storage.newest_committed(d) == 4 and storage.latest_step(d) is None
    _shard(d, 5, 0, 1, b"5" * 8, b)
    assert storage.try_commit(d, 5, 1, keep=5)
    assert storage.lineage_steps(d) == [4, 5] and storage.latest_step(d) == 5
    _shard(d, 6, 0, 1, b"x" * 8, b)
    assert storage.try_commit(d, 6, 1, keep=5)
    assert _data(d, 6) == b"x" * 8 and storage.lineage_steps(d) == [4, 5, 6]


def test_a_rank_never_rewrites_its_files_in_place(tmp_path):
    d = str(tmp_path)
    att = storage.make_attempt("r", 1, "e")
    first = _shard(d, 2, 0, 1, b"1" * 16, att, seq=3)
    tmp = storage.tmp_dir(d, 2)
    first_file = os.path.join(tmp, first["files"]["rank_00000.data"]["tmp"])
    ino = os.stat(first_file).st_ino
    second = _shard(d, 2, 0, 1, b"2" * 16, att, seq=4)  # the same rank and step again
    assert second["files"]["rank_00000.data"]["tmp"] != first["files"]["rank_00000.data"]["tmp"]
    assert os.stat(first_file).st_ino == ino and open(first_file, "rb").read() == b"1" * 16
    assert storage.try_commit(d, 2, 1, keep=2)
    assert _data(d, 2) == b"2" * 16  # the newest sequence number of the rank wins


def test_the_attempt_trailer_survives_the_meta_block():
    import torch

    from dlrover_plugin_flashckpt import layout

    table, _, skeleton = layout.build_table({"w": torch.zeros(3)})
    att = storage.make_attempt("run", 2, "e")
    blob = pack_meta(4, table, skeleton, {"rank": 1}) + storage.attempt_trailer(att)
    assert unpack_meta(blob)["step"] == 4  # it reads the length its header gives
    assert storage.meta_attempt(blob) == att
    assert storage.meta_attempt(pack_meta(4, table, skeleton, {})) is None


# ----------------------------------------------------------------------------- item 6
class _ShortFileIO(io.FileIO):
    """A raw file whose ``write`` writes at most 7 bytes a call, as FUSE or NFS may."""

    def write(self, b):
        return super().write(memoryview(b)[:7])


def test_write_all_loops_until_every_byte_is_written(tmp_path):
    path = str(tmp_path / "f")
    with _ShortFileIO(path, "w") as f:
        assert write_all(f, b"0123456789" * 5) == 50
    assert open(path, "rb").read() == b"0123456789" * 5

    class Stuck(io.FileIO):
        def write(self, b):
            return 0

    with Stuck(path, "w") as f, pytest.raises(OSError, match="wrote nothing at byte 0"):
        write_all(f, b"x")


def test_short_writes_still_commit_whole_shards(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setattr(storage, "_open_for_write", lambda p: _ShortFileIO(p, "x"))
    payload = bytes(range(256)) * 3
    _shard(d, 1, 0, 1, payload)
    assert storage.try_commit(d, 1, 1, keep=2)
    storage.verify_step(os.path.join(d, "step_00000001"))
    assert _data(d, 1) == payload


def test_a_file_cut_short_after_its_marker_is_not_committed(tmp_path):
    d = str(tmp_path)
    marker = _shard(d, 1, 0, 1, b"z" * 500)
    os.truncate(os.path.join(storage.tmp_dir(d, 1), marker["files"]["rank_00000.data"]["tmp"]),
                100)
    with pytest.raises(CorruptCheckpointError, match="has 100 bytes, its marker says 500"):
        storage.try_commit(d, 1, 1, keep=2)
    assert storage.newest_committed(d) is None
    assert not os.path.exists(storage.lock_path(d, 1))
    # its marker is dropped: the persister no longer counts the rank as written, and
    # writes it again (a kept marker would fail the commit forever)
    assert storage.read_markers(storage.tmp_dir(d, 1)) == []
    assert storage.written_saves(d, 1) == set()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs the right to mount: root here); skipped where denied."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield str(where)
    finally:
        # a job's persister may still hold a file in it for a moment (seen on a loaded
        # machine: "target is busy"): retry, then detach it lazily
        deadline = time.monotonic() + 30
        while subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                subprocess.run(["umount", "-l", str(where)], check=True)
                break
            time.sleep(0.5)


def test_full_checkpoint_folder_fails_the_write_and_commits_nothing(small_tmpfs, tmp_path):
    """The persister's loop (a real FlashPersister thread) writes step 2, twice the
    tmpfs: the write fails with ENOSPC, nothing of it is kept, step 1 stays the
    newest and whole, and the persister's status says that persisting fails."""
    from persist_scenario import make_slot, persister, stop, wait_for

    d, shm_dir = os.path.join(small_tmpfs, "ckpt"), str(tmp_path / "shm")
    os.mkdir(shm_dir)
    seg = make_slot(shm_dir, "full", d, 0, 1, 1, b"a" * 1000, cap=2 << 20)
    p = persister(shm_dir, "full", d, 1)
    try:
        assert p.flush("trainer", 1, timeout=20) == 1
        p.loop.failures.min_s = p.loop.failures.max_s = 5.0  # no retry while the folder is listed
        make_slot(shm_dir, "full", d, 0, 1, 2, b"b" * (2 << 20), seg=seg)
        p.loop.thread.wake()
        failing = wait_for(lambda: p.status()["failing"], 20, "persisting fails")
        assert "step 2" in failing["what"] and os.strerror(errno.ENOSPC) in failing["error"]
        assert os.listdir(storage.tmp_dir(d, 2)) == []  # the partial data file removed
        assert storage.lineage_steps(d) == [1] and storage.newest_committed(d) == 1
        assert _data(d, 1) == b"a" * 1000
        assert seg.read_header().persisted_seq != seg.read_header().seq
    finally:
        stop(p)


# ----------------------------------------------------------------------------- item 7
_KILL_AT = """
import os, signal, sys
import dlrover_core.atomic_io as aio
from dlrover_plugin_flashckpt import storage

d, kill_at, exchange = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
renames = []


def step(fn, *args):
    renames.append(args)
    if kill_at >= 0 and len(renames) > kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return fn(*args)


real_rename, real_replace, real_exchange = os.rename, os.replace, aio._exchange
os.rename = lambda a, b: step(real_rename, a, b)
os.replace = lambda a, b: step(real_replace, a, b)
aio._exchange = (lambda a, b: step(real_exchange, a, b)) if exchange else (lambda a, b: False)
print(storage.try_commit(d, 4, 2, keep=2), len(renames))
"""


def _commit_in_child(d, kill_at=-1, exchange=True, point=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLROVER_CRASHPOINT")}
    if point:
        env["DLROVER_CRASHPOINT"] = point
    return subprocess.run([sys.executable, "-c", _KILL_AT, d, str(kill_at), str(int(exchange))],
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("exchange", [True, False])
def test_recommitting_a_step_never_leaves_it_missing(tmp_path, exchange):
    """Step 4 is committed again by a new attempt, in a child process SIGKILLed at
    each rename of the commit (its intent, the shards to their plain names, the
    manifest, the swap of the step directory or its two renames where the filesystem
    has no atomic exchange, ``latest``, the lock's release) and at each crash point of
    the commit. Afterwards step 4 is always listed and verifies, whole old or new; the
    lock the dead committer held is left behind, and the next committer (this
    process) finishes the commit: step 4 is the new attempt's."""
    outcomes = set()
    points = [n for n in sorted(crashpoints.POINTS) if n.startswith("flash.commit.")]
    runs = [(k, None) for k in range(20)] + [(-1, n) for n in points]
    renames_passed = False
    for i, (kill_at, point) in enumerate(runs):
        if point is None and renames_passed:
            continue  # every rename was passed: the later kill points are never reached
        d = str(tmp_path / f"c{i}")
        old = storage.make_attempt("r", 2, "old")
        for r in range(2):
            _shard(d, 4, r, 2, b"o" * 40, old)
        assert storage.try_commit(d, 4, 2, keep=2)
        new = storage.make_attempt("r", 2, "new")
        for r in range(2):
            _shard(d, 4, r, 2, b"n" * 40, new)
        got = _commit_in_child(d, kill_at, exchange, point)
        killed = got.returncode == -9
        assert killed or got.returncode == 0, got.stderr[-2000:]
        if not killed:
            # the crash points are each reached by a commit of a step committed before
            # (they ran after this loop's ``break`` before: never, so the old copy a
            # swap left in the temp directory went unseen)
            assert point is None, f"crash point {point} was not reached"
            assert got.stdout.split()[0] == "True", got.stdout
            outcomes.add((False, True))
            renames_passed = True
            continue
        assert storage.lineage_steps(d) == [4], (kill_at, point)
        manifest = storage.verify_step(os.path.join(d, "step_00000004"))
        data = {_data(d, 4, r) for r in range(2)}
        assert data in ({b"o" * 40}, {b"n" * 40}), (kill_at, point)  # never a mix
        assert manifest["attempt"] == (new if data == {b"n" * 40} else old)
        outcomes.add((True, data == {b"n" * 40}))
        # the next committer finishes (or redoes) the commit of the new attempt
        storage.try_commit(d, 4, 2, keep=2)
        storage.finish_tail(d, keep=2)
        assert {_data(d, 4, r) for r in range(2)} == {b"n" * 40}, (kill_at, point)
        assert storage.verify_step(os.path.join(d, "step_00000004"))["attempt"] == new
        assert storage.latest_step(d) == 4
        assert sorted(os.listdir(d)) == ["latest", "step_00000004"], (kill_at, point)
    assert outcomes == {(True, False), (True, True), (False, True)}


# ----------------------------------------------------------------------------- item 9
def _lease(d, step, lease):
    with open(storage.lock_path(d, step), "w") as f:
        json.dump(lease, f)


def test_commit_lock_takeover_rule(tmp_path, monkeypatch):
    """A commit lock is taken over when its holder is gone: on this host a process
    (pid, start time) that no longer runs, even when its pid is reused; on any host a
    lease this process has seen unchanged for LOCK_STALE_S on its own clock, never
    by the lease's wall-clock time. A takeover that finds another lease than the one
    it judged gives it back."""
    monkeypatch.setattr(commitlock, "LOCK_STALE_S", 0.5)
    d = str(tmp_path)
    _shard(d, 1, 0, 1, b"a" * 10)
    me, start = shm.my_identity()
    host = socket.gethostname()
    # another host, a lease written "long ago" by its clock: not judged by the clock
    _lease(d, 1, {"host": "elsewhere", "pid": 1, "start": 5, "nonce": "a" * 16,
                  "time": time.time() - 10 * storage.LOCK_STALE_S})
    assert not storage.try_commit(d, 1, 1, keep=3)
    time.sleep(0.3)
    _lease(d, 1, {"host": "elsewhere", "pid": 1, "start": 5, "nonce": "b" * 16,
                  "time": 0})  # renewed: seen anew
    time.sleep(0.3)
    assert not storage.try_commit(d, 1, 1, keep=3)
    _lease(d, 1, {"host": host, "pid": me, "start": start, "nonce": "c" * 16, "time": 0})
    time.sleep(0.6)
    assert not storage.try_commit(d, 1, 1, keep=3)  # a live holder here: first seen now
    # a reused pid: this process's pid with another start time is not the holder
    _lease(d, 1, {"host": host, "pid": me, "start": start + 1, "nonce": "d" * 16, "time": 0})
    assert storage.try_commit(d, 1, 1, keep=3)
    _shard(d, 2, 0, 1, b"b" * 10)
    dead = subprocess.Popen(["true"])
    dead.wait()
    _lease(d, 2, {"host": host, "pid": dead.pid, "start": 1, "nonce": "e" * 16, "time": 0})
    assert storage.try_commit(d, 2, 1, keep=3)  # this host, the holder is gone
    _shard(d, 3, 0, 1, b"c" * 10)
    _lease(d, 3, {"host": "elsewhere", "pid": 1, "start": 5, "nonce": "f" * 16, "time": 0})
    assert not storage.try_commit(d, 3, 1, keep=3)  # first seen now
    time.sleep(0.6)
    assert storage.try_commit(d, 3, 1, keep=3)  # seen unchanged for LOCK_STALE_S
    assert storage.lineage_steps(d) == [1, 2, 3]
    assert not [n for n in os.listdir(d) if "commit" in n]
    # the lease judged stale was replaced by another taker's meanwhile: given back
    path = storage.lock_path(d, 4)
    fresh = {"host": "elsewhere", "pid": 2, "start": 6, "nonce": "9" * 16, "time": 0}
    _lease(d, 4, fresh)
    assert not commitlock.take_over(path, {**fresh, "nonce": "8" * 16})
    assert commitlock.read_lease(path) == fresh
    assert [n for n in os.listdir(d) if "commit" in n] == [os.path.basename(path)]


def test_every_return_of_a_commit_releases_its_lock(tmp_path, monkeypatch):
    """The lineage changes (another process restores an older step) while a commit
    takes its lock: the commit finds no accepted set any more and returns False. Its
    lock is released all the same, so the next commit of the step is not blocked for
    LOCK_STALE_S."""
    d = str(tmp_path)
    a = storage.make_attempt("r", 1, "a")
    _shard(d, 5, 0, 1, b"x" * 8, a)
    storage.start_lineage(d, a, base=None)
    real_take = commitlock.take

    def take_while_the_lineage_changes(path):
        lease = real_take(path)
        storage.start_lineage(d, storage.make_attempt("r", 1, "b"), base=3)
        return lease

    monkeypatch.setattr(commitlock, "take", take_while_the_lineage_changes)
    assert not storage.try_commit(d, 5, 1, keep=2)
    monkeypatch.undo()
    assert not [n for n in os.listdir(d) if "commit" in n]
    storage.start_lineage(d, a, base=None)
    assert storage.try_commit(d, 5, 1, keep=2)  # at once, not LOCK_STALE_S later
