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
import time

import pytest

from dlrover_core.atomic_io import write_all
from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.testing import crash_renames_after
from dlrover_plugin_flashckpt import storage
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
    assert not os.path.exists(os.path.join(storage.tmp_dir(d, 1), ".commit"))


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
        subprocess.run(["umount", str(where)], check=True)


def test_full_checkpoint_folder_fails_the_write_and_commits_nothing(small_tmpfs):
    d = small_tmpfs
    _shard(d, 1, 0, 1, b"a" * 1000)
    assert storage.try_commit(d, 1, 1, keep=2)
    with pytest.raises(OSError) as e:
        _shard(d, 2, 0, 1, b"b" * (2 << 20))  # twice the tmpfs
    assert e.value.errno == errno.ENOSPC
    assert not storage.try_commit(d, 2, 1, keep=2)
    assert storage.lineage_steps(d) == [1] and storage.newest_committed(d) == 1
    assert _data(d, 1) == b"a" * 1000


# ----------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("exchange", [True, False])
def test_recommitting_a_step_never_leaves_it_missing(tmp_path, monkeypatch, exchange):
    """Step 4 is committed again by a new attempt. A crash is injected at each rename
    of the commit (the shards to their plain names, the manifest, the swap of the step
    directory or its two renames where the filesystem has no atomic exchange, then
    ``latest``): afterwards step 4 is always listed and verifies, whole old or new."""
    outcomes = set()
    for crash_at in range(12):
        d = str(tmp_path / f"c{crash_at}")
        old = storage.make_attempt("r", 2, "old")
        for r in range(2):
            _shard(d, 4, r, 2, b"o" * 40, old)
        assert storage.try_commit(d, 4, 2, keep=2)
        new = storage.make_attempt("r", 2, "new")
        for r in range(2):
            _shard(d, 4, r, 2, b"n" * 40, new)
        crash_renames_after(monkeypatch, crash_at, exchange)
        try:
            crashed = not storage.try_commit(d, 4, 2, keep=2)
        except OSError:
            crashed = True
        monkeypatch.undo()
        assert storage.lineage_steps(d) == [4], crash_at
        manifest = storage.verify_step(os.path.join(d, "step_00000004"))
        got = {_data(d, 4, r) for r in range(2)}
        assert got in ({b"o" * 40}, {b"n" * 40}), crash_at  # never a mix
        assert manifest["attempt"] == (new if got == {b"n" * 40} else old)
        outcomes.add((crashed, got == {b"n" * 40}))
    assert outcomes == {(True, False), (True, True), (False, True)}


# ----------------------------------------------------------------------------- item 9
def _lock(d, step, owner):
    with open(os.path.join(storage.tmp_dir(d, step), ".commit"), "w") as f:
        json.dump(owner, f)


def test_commit_lock_takeover_rule(tmp_path):
    """A ``.commit`` lock is taken over when its holder is gone: on this host a dead
    pid, on any host a lock older than LOCK_STALE_S; a fresh lock of a live holder
    (or of another host) is respected."""
    d = str(tmp_path)
    _shard(d, 1, 0, 1, b"a" * 10)
    now = time.time()
    _lock(d, 1, {"host": "elsewhere", "pid": 1, "time": now - 10})
    assert not storage.try_commit(d, 1, 1, keep=2)  # fresh, another host: respected
    _lock(d, 1, {"host": socket.gethostname(), "pid": os.getpid(), "time": now})
    assert not storage.try_commit(d, 1, 1, keep=2)  # a live holder here
    _lock(d, 1, {"host": "elsewhere", "pid": 1, "time": now - storage.LOCK_STALE_S - 5})
    assert storage.try_commit(d, 1, 1, keep=2)  # stale, another host: taken over
    _shard(d, 2, 0, 1, b"b" * 10)
    dead = subprocess.Popen(["true"])
    dead.wait()
    _lock(d, 2, {"host": socket.gethostname(), "pid": dead.pid, "time": now})
    assert storage.try_commit(d, 2, 1, keep=2)  # this host, the holder is gone
    assert storage.lineage_steps(d) == [1, 2]
    assert not [n for n in os.listdir(os.path.join(d, "step_00000002")) if "commit" in n]
