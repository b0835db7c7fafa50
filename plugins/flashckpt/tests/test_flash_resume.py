"""Issue 49 ("resume is always right"), the load side: a load restores the newest step
of the current lineage, the same attempt on every rank, raises for a step that is not
there, never takes a buffer an earlier run left behind, and a failed re-layout keeps
the step its slot held. Real saver, real per-node persister actor, real buffers."""

from __future__ import annotations

import json
import os
import time

import pytest
import ray
from test_flash_saver import blank, make_saver, same, state

from dlrover_core.checkpoint.manifest import CheckpointLoadError
from dlrover_plugin_flashckpt import choice, hygiene, shm, storage
from dlrover_plugin_flashckpt.committer import Committer
from dlrover_plugin_flashckpt.failures import PersistFailures
from dlrover_plugin_flashckpt.node_ranks import NodeRanks
from dlrover_plugin_flashckpt.registration import Registration
from plugins.flashckpt.tests.flash_workloads import SaverRank


def lineage_of(d: str) -> dict:
    with open(os.path.join(d, storage.LINEAGE)) as f:
        return json.load(f)


def test_loading_a_step_that_is_not_there_raises_and_keeps_the_lineage(job, tmp_path):
    """Item 1: with 100/200/300 committed, load(step=250) raises (it returned None, the
    job trained from 0 and the next save re-based the lineage: every earlier commit
    orphaned)."""
    d = str(tmp_path / "ckpt")
    first = make_saver(job, d)
    for step in (100, 200, 300):
        first.save(step, state(step))
        first.wait()
    assert first.committed_steps() == [200, 300]  # keep=2
    first.close()
    hygiene.remove_job("/dev/shm", job)  # only the disk is left
    before = lineage_of(d)
    s = make_saver(job, d)
    with pytest.raises(CheckpointLoadError, match="step 250 is not committed"):
        s.load(blank(), step=250)
    assert lineage_of(d) == before
    s.save(310, state(310))
    s.wait()
    assert s.committed_steps() == [300, 310]  # the lineage goes on from 300
    s.close()
    got = blank()
    last = make_saver(job, d)
    assert last.load(got) == 310 and same(got, state(310))
    last.close()


def test_loading_a_step_missing_from_memory_and_disk_raises(job, tmp_path):
    """Item 1, memory: steps 1 and 2 only in memory (never persisted); step 5 is
    nowhere."""
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d, persist_every_steps=100)
    s.save(1, state(1))
    s.save(2, state(2))
    got = blank()
    with pytest.raises(CheckpointLoadError, match="step 5"):
        make_saver(job, d, persist_every_steps=100).load(got, step=5)
    again = make_saver(job, d, persist_every_steps=100)
    assert again.load(got, step=1) == 1
    assert same(got, state(1))
    again.close()
    s.close()


def _commit_100_200_300(job: str, d: str) -> None:
    """A saver saves and commits 100, 200 and 300 into ``d`` (keep=2), then closes;
    its buffers stay."""
    first = make_saver(job, d)
    for step in (100, 200, 300):
        first.save(step, state(step))
        first.wait()
    first.close()


def test_a_rolled_back_lineage_never_loads_the_abandoned_buffer(job, tmp_path):
    """Item 2: 100, 200, 300 saved and committed; a new incarnation rolls back to 200
    and commits 210. Shared memory still holds the abandoned 300 (the other slot): a
    restart loads 210, the newest step of the current lineage, not 300."""
    d = str(tmp_path / "ckpt")
    _commit_100_200_300(job, d)
    back = make_saver(job, d)
    got = blank()
    assert back.load(got, step=200) == 200 and same(got, state(200))
    back.save(210, state(210))
    back.wait()
    back.close()
    held = {h.step for h in _headers(job, d)}
    assert 300 in held  # the abandoned save is still in memory: the load must refuse it
    again = make_saver(job, d)
    got = blank()
    assert again.load(got) == 210
    assert same(got, state(210)) and again.last_load_source == "memory"
    again.close()


def test_a_rollback_save_is_not_retired_against_the_lineage_read_before_it(job, tmp_path):
    """Found by CI (the test above timed out in ``wait()``: "step 210 ... 0 of 1 ranks
    written"): the persister read the lineage (newest 300) just before the rollback's
    first save wrote the new one, and read the slot just after the save of 210 was
    READY; it marked 210 persisted (at or below 300) and never wrote it. That
    interleaving is made here by hand: the persister's view of the directory is taken
    before the save and the persister's retire runs after it. Real saver, persister
    and buffers; the retire is the persister's code run in this process."""
    d = str(tmp_path / "ckpt")
    _commit_100_200_300(job, d)
    # 210 is not due: the real persister leaves it alone until wait() forces it
    back = make_saver(job, d, persist_every_steps=1000, wait_timeout_s=20)
    assert back.load(blank(), step=200) == 200
    old_lineage, newest = storage.newest_with_lineage(d)
    assert newest == 300  # the view of a persister that read just before the save
    back.save(210, state(210))
    ranks = NodeRanks(job, *shm.my_identity())
    ranks.regs[("", 0)] = Registration(**back._registration())  # not stamped: the real
    # persister stays the buffers' persister
    Committer(ranks, PersistFailures(), lambda *a, **k: None,
              lambda *a: None).retire(ranks.of_role(""), old_lineage, newest)
    h = next(h for h in _headers(job, d) if h.step == 210)
    assert h.persisted_seq != h.seq  # still waiting for the disk
    back.wait()
    assert back.committed_steps() == [200, 210]
    back.close()
    ranks.close_all()
    got = blank()
    again = make_saver(job, d)
    assert again.load(got) == 210 and same(got, state(210))
    again.close()


def test_obsolete_saves_are_judged_against_the_lineage_they_were_read_with():
    """:func:`storage.obsolete`: a save at or below the newest step is obsolete when it
    is the lineage's own attempt's or older than the lineage; a newer attempt's save
    is not, even below the lineage's base (it restored from an older step)."""
    a1 = storage.make_attempt("run", 2, "one")
    a2 = storage.make_attempt("run", 2, "two")
    old = {"attempt": a1, "base": 500, "started": 1000.0}
    assert storage.obsolete(old, 600, 550, a1, 1500.0)  # its own, committed since
    assert storage.obsolete(old, 600, 400, a2, 900.0)  # an earlier attempt's
    assert not storage.obsolete(old, 600, 210, a2, 1500.0)  # a newer attempt's rollback
    assert not storage.obsolete(old, 600, 650, a1, 1500.0)  # above the newest
    assert not storage.obsolete(old, None, 1, a1, 1500.0)
    assert storage.obsolete(None, 600, 210, a2, 1500.0)  # no lineage: any save


def test_submit_fresh_never_resumes_a_buffer_of_the_previous_run(job, tmp_path):
    """Item 3: the previous run's end kept its newest save in memory; `--fresh` moved
    the checkpoint folder aside. The fresh run's load starts from nothing (it restored
    step 7 and re-based its lineage on it)."""
    d = str(tmp_path / "ckpt")
    old = make_saver(job, d)
    old.save(7, state(7))
    old.wait()
    old.close()
    os.rename(d, str(tmp_path / "ckpt.old"))  # what begin_run(fresh=True) does
    assert any(h.step == 7 for h in _headers(job, d))
    fresh = make_saver(job, d)
    got = blank()
    assert fresh.load(got) is None
    assert not got["model"]["w"].any() and got["extra"]["step"] == -1  # untouched
    fresh.save(1, state(1))
    fresh.wait()
    assert fresh.committed_steps() == [1]
    fresh.close()


@pytest.mark.slow  # 25 s here (2026-12-01): make test's lanes stay near 10 minutes (CI runs it)
def test_two_ranks_never_mix_the_saves_of_two_attempts(job, tmp_path):
    """Item 2, two ranks without a process group: after a rollback to 100, rank 0 saved
    200 in the new attempt and rank 1 died before its save of 200; both ranks' buffers
    hold a step 200 (of different attempts). A restart loads 100 on both (it loaded the
    new 200 on rank 0 and the old 200 on rank 1)."""
    d = str(tmp_path / "ckpt")
    actor = ray.remote(SaverRank).options(num_cpus=0)
    _two_ranks_commit(actor, job, d, (100, 200))
    ranks = [actor.remote(job, d, r, 2, {"wait_timeout_s": 60}) for r in range(2)]
    loads = ray.get([a.load.remote(100) for a in ranks], timeout=180)
    assert [x["step"] for x in loads] == [100, 100]
    ray.get(ranks[0].save.remote(200))  # rank 1 dies before its save of 200
    _kill(ranks)
    by_rank = {}
    for h in _headers(job, d):
        by_rank.setdefault(h.rank, set()).add(h.step)
    assert 200 in by_rank[0] and 200 in by_rank[1]
    ranks = [actor.remote(job, d, r, 2, {"wait_timeout_s": 60}) for r in range(2)]
    loads = ray.get([a.load.remote() for a in ranks], timeout=180)
    assert [(x["step"], x["exact"]) for x in loads] == [(100, True), (100, True)]
    _kill(ranks)
    # rank 0's save of 200 in the rolled-back attempt is of the current lineage and
    # newer than any commit, so the job's end would keep it for a next run: gone here
    hygiene.remove_job("/dev/shm", job)


@pytest.mark.slow  # 14 s: make test's lanes stay under 10 minutes on 2 cores (CI runs it)
def test_ranks_without_a_group_choose_from_rank_zeros_listing(job, tmp_path):
    """Item 4: a commit lands between two ranks' listings of the directory (the old
    incarnation's persister, a stale NFS directory cache). Rank 0 listed 100 only, rank
    1 lists 100 and 200: both load 100, rank 0's view (rank 0 loaded 100 and rank 1
    200). The commit "lands" by renaming the committed step back into place after rank
    0 is seen (through its crash-point trace) waiting in the gather."""
    d = str(tmp_path / "ckpt")
    actor = ray.remote(SaverRank).options(num_cpus=0)
    _two_ranks_commit(actor, job, d, (100, 200))
    hygiene.remove_job("/dev/shm", job)  # the node lost its memory: disk only
    hidden = os.path.join(d, ".landing")
    os.rename(os.path.join(d, "step_00000200"), hidden)
    trace = str(tmp_path / "trace")
    rank0 = ray.remote(SaverRank).options(
        num_cpus=0, runtime_env={"env_vars": {"DLROVER_CRASHPOINT_TRACE": trace}}
    ).remote(job, d, 0, 2, {"wait_timeout_s": 60})
    first = rank0.load.remote()
    deadline = time.monotonic() + 120
    while not (os.path.exists(trace) and "flash.load.gather" in open(trace).read()):
        assert time.monotonic() < deadline, "rank 0 never reached the gather"
        time.sleep(0.05)
    os.rename(hidden, os.path.join(d, "step_00000200"))
    rank1 = actor.remote(job, d, 1, 2, {"wait_timeout_s": 60})
    loads = ray.get([first, rank1.load.remote()], timeout=180)
    assert [(x["step"], x["source"], x["exact"]) for x in loads] == [
        (100, "disk", True), (100, "disk", True)]
    _kill([rank0, rank1])


def test_a_failed_relayout_keeps_the_step_its_slot_held(job, tmp_path):
    """Item 6: a save whose state outgrew its buffer claims the slot, then cannot lay
    out the bigger buffer (ShmSpaceError: a real tmpfs too small). The READY step 110
    that slot held stays loadable from memory (it was marked WRITING and lost, and the
    restart loaded 100 from disk)."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    os.system(f"mount -t tmpfs -o size=4m tmpfs {shm_dir}")
    try:
        d = str(tmp_path / "ckpt")
        opts = {"shm_dir": str(shm_dir), "persist_every_steps": 100, "slots": 1}
        s = make_saver(job, d, **opts)
        s.save(100, state(100))
        s.wait()  # committed: the one slot may take the next save
        s.save(110, state(110))
        with pytest.raises(shm.ShmSpaceError):
            s.save(120, state(120, n=4 << 20))  # 16 MiB: no room in 4 MiB
        s.close()
        got = blank()
        again = make_saver(job, d, **opts)
        assert again.load(got) == 110 and again.last_load_source == "memory"
        assert same(got, state(110))
        again.close()
    finally:
        hygiene.remove_job(str(shm_dir), job)
        os.system(f"umount -l {shm_dir}")  # lazily: the persister may still map it


def test_after_a_damaged_step_the_memory_load_follows_the_new_lineage(job, tmp_path):
    """The damaged-step case with the buffers kept (its test in test_flash_saver.py
    removes them first, so no memory load met the lineage there): step 300 is damaged
    on disk and in memory, the load falls back to 200 from disk, 210 is committed; the
    next load takes 210 from memory, never the abandoned 300 still in a buffer."""
    d = str(tmp_path / "ckpt")
    first = make_saver(job, d)
    for step in (200, 300):
        first.save(step, state(step))
        first.wait()
    first.close()
    with open(os.path.join(d, "step_00000300", "rank_00000.data"), "r+b") as f:
        f.seek(100)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    for h, path in _buffers(job, d):
        if h.step == 300:
            seg = shm.Segment.attach(path)
            seg.mm[h.data_offset + 10] ^= 0xFF
            seg.close()
    again = make_saver(job, d, verify_memory="data")
    got = blank()
    assert again.load(got) == 200 and again.last_load_source == "disk"
    again.save(210, state(210))
    again.wait()
    again.close()
    assert 300 in {h.step for h in _headers(job, d)}
    last = make_saver(job, d)  # header checks only: the flipped bit would pass
    got = blank()
    assert last.load(got) == 210 and last.last_load_source == "memory"
    assert same(got, state(210))
    last.close()


@pytest.mark.parametrize("point", ["flash.load.verify", "flash.load.disk_read"])
def test_an_io_error_reading_the_newest_step_raises_instead_of_an_older_step(job, tmp_path,
                                                                             point):
    """EIO while the newest committed step is verified or read (its files are whole):
    the load raises, it does not resume from the older step (it did: 1 instead of 2,
    the training since thrown away with only a warning). Then a load without the
    fault resumes 2. The fault is the crash point's EIO, raised where the read is."""
    from dlrover_core import crashpoints

    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    for step in (1, 2):
        s.save(step, state(step))
        s.wait()
    assert s.committed_steps() == [1, 2]
    s.close()
    hygiene.remove_job("/dev/shm", job)
    crashpoints.arm(point, "eio")
    try:
        with pytest.raises(CheckpointLoadError, match="an I/O error, not a damaged file"):
            make_saver(job, d).load(blank())
    finally:
        crashpoints.arm(None)
    got = blank()
    again = make_saver(job, d)
    assert again.load(got) == 2 and same(got, state(2))
    assert again.committed_steps() == [1, 2]  # nothing quarantined
    again.close()


def test_plan_takes_rank_zeros_view_and_refuses_to_choose_alone():
    """Item 4: ranks choose from rank 0's listing of the disk (rank 1 listed after a
    commit of 200 landed: it would load 200 while rank 0 loads 100), and a gather
    that did not reach every rank raises instead of choosing alone."""
    lin = {"attempt": storage.make_attempt("r", 2, "e"), "base": None}
    held = [choice.Held(disk=[100], lineage=lin), choice.Held(disk=[100, 200], lineage=lin)]
    assert choice.plan(held, 2, None, "/ckpt").disk == [100]
    with pytest.raises(CheckpointLoadError, match="only 1 of 2 ranks"):
        choice.plan(held[:1], 2, None, "/ckpt")


def test_plan_takes_memory_only_of_the_current_lineage_and_one_attempt():
    a, b = storage.make_attempt("r", 2, "a"), storage.make_attempt("r", 2, "b")
    ta, tb = storage.attempt_tag(a), storage.attempt_tag(b)
    lin = {"attempt": b, "base": 100}
    # rank 0 holds 200 of both attempts, rank 1 only of the old one: not common in b
    held = [choice.Held(mem=[(100, ta), (200, ta), (200, tb)], disk=[100], lineage=lin),
            choice.Held(mem=[(100, ta), (200, ta)], disk=[100], lineage=lin)]
    p = choice.plan(held, 2, None, "/ckpt")
    assert p.memory == (100, ta, "own") and p.disk == [100] and p.refused == [200]
    held[1].mem.append((200, tb))
    assert choice.plan(held, 2, None, "/ckpt").memory == (200, tb, "own")
    # no lineage (a fresh folder): no buffer belongs to it
    for h in held:
        h.lineage = None
    assert choice.plan(held, 2, None, "/ckpt").memory is None


def _buffers(job: str, d: str) -> list[tuple[shm.Header, str]]:
    """``(header, path)`` of the buffers of ``job`` in /dev/shm holding a step of ``d``."""
    out = []
    for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
        if shm.tmp_owner(path) is not None:   # being laid out in the background
            continue
        seg = shm.Segment.attach(path)
        if seg is None:
            continue
        try:
            h = seg.read_header()
            if shm.holds_step(h) and seg.ident().get("dir") == os.path.abspath(d):
                out.append((h, path))
        finally:
            seg.close()
    return out


def _headers(job: str, d: str) -> list[shm.Header]:
    return [h for h, _ in _buffers(job, d)]


def _two_ranks_commit(actor, job: str, d: str, steps: tuple[int, ...]) -> None:
    """Ranks 0 and 1 of 2 (``actor``: :class:`SaverRank`) save and commit each of
    ``steps``, then are killed; their buffers stay."""
    ranks = [actor.remote(job, d, r, 2, {"wait_timeout_s": 60}) for r in range(2)]
    for step in steps:
        ray.get([a.save.remote(step) for a in ranks])
        ray.get([a.wait.remote() for a in ranks])
    _kill(ranks)


def _kill(actors: list) -> None:
    """Kill the rank actors and wait until each is gone.

    ``ray.kill`` returns before the kill reaches the actor, and a call submitted in
    between can still run (CI saw one), so each actor is called until it answers
    with :class:`ray.exceptions.RayActorError`, for at most 60 s."""
    for a in actors:
        ray.kill(a, no_restart=True)
    deadline = time.monotonic() + 60
    for a in actors:
        while True:
            try:
                ray.get(a.node_id.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"actor {a} still answers 60 s after ray.kill"
            time.sleep(0.2)
