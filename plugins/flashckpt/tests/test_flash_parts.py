"""Each part of the flash saver and persister on its own, without Ray: its state and
its short interface (docs/architecture.md, "The flash saver"). Real shared-memory
buffers (in a test directory) and real files; the persister's parts run their work
in this thread (their threads are not started)."""

from __future__ import annotations

import os

import pytest
import torch

from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.committer import Committer
from dlrover_plugin_flashckpt.failures import PersistFailures
from dlrover_plugin_flashckpt.group import Attempts, RankGroup
from dlrover_plugin_flashckpt.loading import Loader
from dlrover_plugin_flashckpt.meta import pack_meta
from dlrover_plugin_flashckpt.node_ranks import NodeRanks
from dlrover_plugin_flashckpt.options import FlashOptions
from dlrover_plugin_flashckpt.persisting import PersistLoop, Registration
from dlrover_plugin_flashckpt.relayout import Relayout
from dlrover_plugin_flashckpt.replica import ReplicaHolder, ReplicaSender
from dlrover_plugin_flashckpt.slots import SlotPool
from dlrover_plugin_flashckpt.writer import SlotWriter

JOB = "parts"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1000, generator=g), "extra": {"step": step}}


@pytest.fixture
def rank0(tmp_path):
    """A pool of 2 slots of rank 0 of 1 in ``tmp_path/shm``, its writer, its group and
    attempts, and its loader; the pool is closed and its buffers removed afterwards."""
    shm_dir, directory = tmp_path / "shm", str(tmp_path / "ckpt")
    shm_dir.mkdir()
    opts = FlashOptions.parse({"shm_dir": str(shm_dir), "slots": 2, "wait_timeout_s": 5})
    paths = [str(shm_dir / shm.slot_name(JOB, directory, 0, s)) for s in range(2)]
    pool = SlotPool(opts, paths, 0, 1, directory, "trainer",
                    lambda: {"job": JOB, "dir": directory, "rank": 0})
    group = RankGroup(JOB, directory, 0, 1, distributed=False)
    attempts = Attempts(group, lambda: "run")
    loader = Loader(pool, group, None, Relayout(JOB, directory, str(shm_dir), 0, 1,
                                                group.all_ok), opts, directory)
    parts = {"pool": pool, "writer": SlotWriter(pool), "group": group, "attempts": attempts,
             "loader": loader, "dir": directory, "shm_dir": str(shm_dir), "opts": opts}
    yield parts
    pool.close()
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


def write(parts: dict, step: int, due: bool = True) -> dict | None:
    table, sources, skeleton = layout.build_table(state(step))
    attempt = parts["attempts"].current or parts["attempts"].start()
    meta = pack_meta(step, table, skeleton, {"rank": 0, "world_size": 1}) \
        + storage.attempt_trailer(attempt)
    with parts["pool"].lock:
        return parts["writer"].write(step, table, sources, meta, due)


def test_slot_pool_lays_out_its_buffers_and_claims_a_slot(rank0):
    pool = rank0["pool"]
    pool.reserve(8192, wait=True)
    assert pool.last_reserve["data_bytes"] == 8192
    assert [os.path.exists(p) for p in pool.paths] == [True, True]
    assert all(pool.fits(pool.attach(i), 8192, 1024) for i in range(2))
    slot, before = pool.pick(5, due=True)
    h = pool.segs[slot].read_header()
    assert h.state == shm.WRITING and h.seq == before.seq + 1
    pool.unpick(slot, pool.segs[slot], before)  # nothing written: given back as it was
    assert pool.segs[slot].read_header().state == before.state


def test_a_reservation_that_finds_every_slot_in_place_wakes_no_thread(rank0):
    """A survivor's load in place reserves for the state it had: every slot is mapped,
    populated and fits, so nothing runs in the background; a larger state does."""
    pool = rank0["pool"]
    pool.reserve(8192, wait=True)
    assert all(pool.segs[i].populated for i in range(2))
    ran = []
    real = pool._reserve_all
    pool._reserve_all = lambda *a: (ran.append(a), real(*a))[1]
    fut = pool.reserve(4096)
    assert fut.done() and ran == [] and pool.last_reserve["seconds"] == 0.0
    inodes = [pool.segs[i].inode for i in range(2)]
    pool.reserve(1 << 20, wait=True)  # outgrows them: laid out again in the background
    assert len(ran) == 1 and pool.last_reserve["data_bytes"] == 1 << 20
    assert [pool.segs[i].inode for i in range(2)] != inodes
    os.unlink(pool.paths[0])  # a slot's file gone: the background thread sees to it
    pool.reserve(1 << 20, wait=True)
    assert len(ran) == 2 and os.path.exists(pool.paths[0])


def test_slot_pool_skips_a_save_when_every_slot_waits_for_the_disk(rank0):
    assert write(rank0, 1) is not None and write(rank0, 2) is not None
    assert write(rank0, 3, due=False) is None  # both hold a due step not persisted
    assert [s for s, _ in rank0["pool"].skipped] == [3]
    assert "being persisted or holds a step waiting" in rank0["pool"].skipped[0][1]


def test_slot_writer_writes_a_save_ready_with_its_step_and_meta(rank0):
    got = write(rank0, 7)
    assert got is not None and got["laid_out"] and got["bytes"] >= 4000  # 1000 float32
    seg = rank0["pool"].segs[got["slot"]]
    h = seg.read_header()
    assert (h.state, h.step, h.data_len, h.due) == (shm.READY, 7, got["bytes"], 1)
    assert rank0["pool"].newest_saved == 7
    again = write(rank0, 8)
    assert again is not None and again["slot"] != got["slot"]
    with seg.locked():  # as the persister does once step 7 is committed
        h = seg.read_header()
        h.persisted_seq = h.seq
        seg.write_header(h)
    third = write(rank0, 9)  # into the buffer of step 7: it fits
    assert third is not None and third["slot"] == got["slot"] and not third["laid_out"]
    assert seg.read_header().step == 9 and rank0["pool"].newest_saved == 9


def test_rank_group_alone_gathers_itself_and_formats_errors():
    g = RankGroup(JOB, "/x", 0, 1, distributed=False)
    assert g.dist() is None and g.gather({"a": 1}) == [{"a": 1}]
    assert g.all_ok(None) == []
    assert g.all_ok(OSError("gone")) == ["rank 0: OSError: gone"]


def test_attempts_agree_at_load_and_rank0_writes_the_lineage_at_the_first_save(tmp_path):
    directory = str(tmp_path / "ckpt")
    a = Attempts(RankGroup(JOB, directory, 0, 1, distributed=False), lambda: "run-1")
    a.agree(4)
    attempt, base = a.next
    assert base == 4 and a.current is None and storage.read_lineage(directory) is None
    assert a.start() == attempt and a.current == attempt and a.next is None
    assert storage.read_lineage(directory) is not None


def test_loader_reads_the_newest_save_from_the_pool(rank0):
    assert rank0["loader"].load(state(-1), None) == (None, None)
    write(rank0, 3)
    write(rank0, 4)
    live = state(0)
    assert rank0["loader"].load(live, None) == (4, "memory")
    assert torch.equal(live["w"], state(4)["w"]) and live["extra"] == {"step": 4}
    assert rank0["loader"].load(live, 3) == (3, "memory")
    assert torch.equal(live["w"], state(3)["w"])


def slot_of(shm_dir: str, directory: str, rank: int, world: int, step: int) -> shm.Segment:
    from persist_scenario import make_slot

    return make_slot(shm_dir, JOB, directory, rank, world, step, b"x" * 100)


def reg(shm_dir: str, directory: str, rank: int, world: int) -> Registration:
    return Registration(role="trainer", rank=rank, world_size=world, dir=directory, keep=2,
                        slots=[os.path.join(shm_dir, shm.slot_name(JOB, directory, rank, 0))],
                        shm_dir=shm_dir)


def test_node_ranks_keep_one_run_of_a_role_and_check_paths(tmp_path):
    shm_dir, d = str(tmp_path), str(tmp_path / "ckpt")
    ranks = NodeRanks(JOB, *shm.my_identity())
    seg = slot_of(shm_dir, d, 0, 2, 3)
    try:
        ranks.register(reg(shm_dir, d, 0, 2))
        ranks.register(reg(shm_dir, d, 1, 2))
        assert seg.read_header().persister_pid == os.getpid()  # stamped
        assert set(ranks.rank_steps(ranks.reg_of("trainer"), pending_only=True)) == {3}
        assert ranks.common_steps(ranks.of_role("trainer")) == set()  # rank 1 holds none
        ranks.register(reg(shm_dir, d, 0, 1))  # the role came back with 1 rank
        assert list(ranks.regs) == [("trainer", 0)]
        assert ranks.allowed_dir(d) == d and ranks.allowed_shm_dir(shm_dir) == shm_dir
        with pytest.raises(ValueError, match="is not this job's"):
            ranks.allowed_dir("/etc")
        with pytest.raises(ValueError, match="is not allowed"):
            ranks.allowed_shm_dir("/tmp")
    finally:
        ranks.close_all()
        seg.close()


def test_a_step_committed_by_another_node_since_it_was_picked_is_not_claimed(tmp_path):
    """Rank 0's save of step 5 (world 2) is held here; its files and rank 1's are
    written and "another node" commits 5 (consuming the markers, renaming the temp
    directory) after this persister read the newest step and before it read the
    markers: it picked 5 again. Its claim must take nothing: it took the slot, the
    loop wrote rank 0's files again and left ``.step_00000005.tmp`` behind the commit,
    which nothing removed while 5 was the newest step. A late write that still comes
    is removed by that writer's commit try."""
    shm_dir, d = str(tmp_path), str(tmp_path / "ckpt")
    ranks = NodeRanks(JOB, *shm.my_identity())
    seg = slot_of(shm_dir, d, 0, 2, 5)
    try:
        ranks.register(reg(shm_dir, d, 0, 2))
        loop = PersistLoop(ranks)  # its thread is not started: the test drives it
        assert loop._pick() == ("trainer", 5)  # picked before the other node's commit
        h = seg.read_header()
        for r in range(2):  # rank 0's files (written here before) and rank 1's
            storage.write_shard(d, 5, r, 2, seg.meta_bytes(h), memoryview(b"x" * 100),
                                extra={"seq": h.seq, "saved_at": h.saved_at})
        assert storage.try_commit(d, 5, 2, keep=2)
        assert loop.claim("trainer", 5) == []
        assert seg.read_header().state == shm.READY
        assert not os.path.exists(storage.tmp_dir(d, 5))
        storage.write_shard(d, 5, 0, 2, seg.meta_bytes(h), memoryview(b"x" * 100),
                            extra={"seq": h.seq, "saved_at": h.saved_at})  # a late write
        assert not storage.try_commit(d, 5, 2, keep=2)
        assert not os.path.exists(storage.tmp_dir(d, 5))
        assert storage.lineage_steps(d) == [5]
    finally:
        ranks.close_all()
        seg.close()


def test_persist_loop_writes_and_its_committer_commits_a_step(tmp_path):
    shm_dir, d = str(tmp_path), str(tmp_path / "ckpt")
    ranks = NodeRanks(JOB, *shm.my_identity())
    segs = [slot_of(shm_dir, d, r, 2, 5) for r in range(2)]
    try:
        for r in range(2):
            ranks.register(reg(shm_dir, d, r, 2))
        loop = PersistLoop(ranks)  # its thread is not started: the test drives it
        assert loop._persist_one()
        assert storage.newest_committed(d) == 5
        assert [h["step"] for h in loop.history] == [5] and loop.history[0]["committed"]
        assert not loop.committer.is_committing(d) and loop.errors == []
        for seg in segs:  # persisted once committed; a save may take the slot now
            h = seg.read_header()
            assert h.state == shm.READY and h.persisted_seq == h.seq and h.crc_seq == h.seq
        assert not loop._persist_one()  # nothing left
    finally:
        ranks.close_all()
        for seg in segs:
            seg.close()


def test_committer_waits_for_every_rank_and_forced_steps_end_when_committed(tmp_path):
    shm_dir, d = str(tmp_path), str(tmp_path / "ckpt")
    ranks = NodeRanks(JOB, *shm.my_identity())
    seg = slot_of(shm_dir, d, 0, 2, 9)
    landed = []
    try:
        ranks.register(reg(shm_dir, d, 0, 2))  # rank 1 is on another node
        loop = PersistLoop(ranks)
        loop.force("trainer", 9)
        loop._persist_one()  # rank 0's files written, rank 1's missing
        assert loop.history[-1]["ranks"] == [0] and not loop.history[-1]["committed"]
        assert storage.newest_committed(d) is None and loop.forced == {"trainer": {9}}
        committer = Committer(ranks, PersistFailures(), lambda *a, **k: None,
                              lambda role, step: landed.append((role, step)))
        # this node's files are all written: a candidate, whose commit cannot land yet
        assert [c[1] for c in committer.candidates()] == [9]
        attempt = storage.make_attempt("", 2)
        assert committer.commit("trainer", 9, ranks.reg_of("trainer"), attempt) is False
        assert landed == [] and not committer.is_committing(d)
        storage.write_shard(d, 9, 1, 2, b"meta1", memoryview(b"y" * 100), attempt=attempt)
        assert committer.commit("trainer", 9, ranks.reg_of("trainer"), attempt) is True
        assert storage.newest_committed(d) == 9 and landed == [("trainer", 9)]
        h = seg.read_header()
        assert h.persisted_seq == h.seq  # the committed save counts as persisted
    finally:
        ranks.close_all()
        seg.close()


def test_replica_holder_stores_lists_and_reads_and_checks_paths(tmp_path):
    shm_dir, d = str(tmp_path), "/ckpt/trainer"
    ranks = NodeRanks(JOB, *shm.my_identity())
    ranks.register(Registration(role="trainer", rank=0, world_size=1, dir=d, keep=1,
                                slots=[], shm_dir=shm_dir))
    holder = ReplicaHolder(ranks, JOB, "", "ab12cd34ef56")
    info = {"dir": d, "rank": 3, "world_size": 4, "step": 11, "meta": b"m3",
            "data_len": 5, "shm_dir": shm_dir}
    name = holder.store(info, b"hello")
    try:
        held = holder.listed(d, shm_dir)["held"]
        assert [(r["rank"], r["step"]) for r in held] == [(3, 11)]
        got = holder.read(os.path.join(shm_dir, name), 11)
        assert bytes(got["data"]) == b"hello" and bytes(got["meta"]) == b"m3"
        with pytest.raises(ValueError, match="not a replica buffer"):
            holder.read(os.path.join(shm_dir, "other"), 11)
        with pytest.raises(ValueError, match="is not this job's"):
            holder.store({**info, "dir": "/elsewhere"}, b"hello")
        sender = ReplicaSender(ranks, "ab12cd34ef56", lambda node: None, lambda msg: None)
        assert sender.status() == {"replicated": {}, "history": []}
        assert not sender._replicate_one()  # no rank asks for replicas
    finally:
        for p in os.listdir(shm_dir):
            os.unlink(os.path.join(shm_dir, p))


def test_replica_holder_keeps_its_buffers_mapped_and_drops_removed_ones(tmp_path):
    shm_dir, d = str(tmp_path), "/ckpt/trainer"
    ranks = NodeRanks(JOB, *shm.my_identity())
    ranks.register(Registration(role="trainer", rank=0, world_size=1, dir=d, keep=1,
                                slots=[], shm_dir=shm_dir))
    holder = ReplicaHolder(ranks, JOB, "", "ab12cd34ef56")
    info = {"dir": d, "rank": 1, "world_size": 2, "meta": b"m", "data_len": 4096,
            "shm_dir": shm_dir}
    try:
        first = holder.store({**info, "step": 1}, b"a" * 4096)
        second = holder.store({**info, "step": 2}, b"b" * 4096)
        assert first != second  # two replica buffers of the rank, alternating
        mapped = dict(holder._mapped)
        assert sorted(os.path.basename(p) for p in mapped) == sorted([first, second])
        assert all(seg.populated for seg in mapped.values())
        third = holder.store({**info, "step": 3}, b"c" * 4096)
        assert third == first  # the older buffer, written through the same mapping
        assert all(holder._mapped[p] is seg for p, seg in mapped.items())
        got = holder.read(os.path.join(shm_dir, third), 3)
        assert bytes(got["data"]) == b"c" * 4096
        os.unlink(os.path.join(shm_dir, second))  # removed (e.g. by the buffer hygiene)
        holder.store({**info, "step": 4}, b"d" * 4096)
        gone = mapped[os.path.join(shm_dir, second)]
        assert gone.mm.closed  # its memory is not held by a stale mapping
        assert holder._mapped[os.path.join(shm_dir, second)] is not gone
    finally:
        for p in os.listdir(shm_dir):
            os.unlink(os.path.join(shm_dir, p))


def test_loop_thread_runs_its_loop_when_woken_and_ends():
    import threading

    from dlrover_plugin_flashckpt.loopthread import LoopThread

    rounds = threading.Semaphore(0)

    def loop() -> None:
        while not t.stopping:
            t.pause(3600)  # only a wake or the end ends the pause
            rounds.release()

    t = LoopThread("test-loop", loop)
    t.begin()
    assert t.alive()
    t.wake()
    assert rounds.acquire(timeout=30)  # one round for the wake
    t.end(30)
    assert not t.alive() and t.stopping


def test_copy_bytes_is_bit_for_bit_for_every_dtype():
    """The warm load's copy from a mapping (``reader.copy_bytes``) views the bytes as the
    destination's dtype where it can: it must still copy bits, not values (a NaN's
    payload, -0.0, bool bytes)."""
    from dlrover_plugin_flashckpt.reader import copy_bytes

    nan_payload = torch.tensor([0x7FC01234, -0x80000000, 0x7F800001], dtype=torch.int32)
    cases = [nan_payload.view(torch.float32), torch.randn(33, dtype=torch.float64),
             torch.randn(17).to(torch.bfloat16), torch.tensor([True, False, True]),
             torch.arange(-5, 5, dtype=torch.int8), torch.randn(4, dtype=torch.complex64)]
    for want in cases:
        src = want.view(-1).view(torch.uint8).clone()
        dst = torch.zeros_like(want).view(-1)
        copy_bytes(dst, src)
        assert torch.equal(dst.view(torch.uint8), src), want.dtype
