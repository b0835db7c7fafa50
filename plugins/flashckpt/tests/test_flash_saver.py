"""The flash saver with its real per-node persister actor on a local Ray cluster; the
training process is this pytest process (one rank, no process group)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import ray
import torch

from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_plugin_flashckpt import hygiene, shm
from dlrover_plugin_flashckpt.persister import persisters_of
from dlrover_plugin_flashckpt.saver import FlashSaver


def make_saver(job: str, directory: str, **options) -> FlashSaver:
    return FlashSaver(SaverConfig(dir=directory, keep=2, job=job,
                                  options={"wait_timeout_s": 60, **options}), SaverContext())


def state(seed: int, n: int = 4096) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "h": torch.randn(8, 8, generator=g).half()},
            "optimizer": {"state": {0: {"step": torch.tensor(float(seed))}},
                          "param_groups": [{"lr": 0.1 * seed}]},
            "extra": {"step": seed, "rng": torch.get_rng_state()}}


def blank(n: int = 4096) -> dict:
    return {"model": {"w": torch.zeros(n), "h": torch.zeros(8, 8).half()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.0}]}, "extra": {"step": -1}}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"]["w"], b["model"]["w"])
            and torch.equal(a["model"]["h"], b["model"]["h"])
            and a["extra"]["step"] == b["extra"]["step"]
            and torch.equal(a["optimizer"]["state"][0]["step"], b["optimizer"]["state"][0]["step"]))


def on_disk_only(job: str, directory: str, steps: tuple[int, ...]) -> None:
    """Save :func:`state` of each of ``steps`` and wait until it is persisted (the
    committed steps are checked); then close the saver and remove the job's buffers, as
    after a node loss: only the disk is left."""
    s = make_saver(job, directory)
    for step in steps:
        s.save(step, state(step))
        s.wait()
    assert s.committed_steps() == list(steps)
    s.close()
    hygiene.remove_job("/dev/shm", job)


def test_save_wait_load_from_memory_and_disk(job, tmp_path):
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    s.save(1, state(1))
    s.save(2, state(2))
    s.wait()
    committed = s.committed_steps()  # step 1 is persisted only if it was not retired first
    assert committed in ([1, 2], [2])
    assert open(os.path.join(d, "latest")).read().strip() == "2"
    s.close()

    fresh = make_saver(job, d)  # a new process of the same rank would see the same buffers
    got = blank()
    assert fresh.load(got) == 2 and fresh.last_load_source == "memory"
    assert same(got, state(2))
    got = blank()
    # the other slot still holds step 1 (two slots): it loads from memory
    assert fresh.load(got, step=1) == 1 and fresh.last_load_source == "memory"
    assert same(got, state(1))

    hygiene.remove_job("/dev/shm", job)  # the node lost its memory
    disk = make_saver(job, d)
    got = blank()
    assert disk.load(got) == 2 and disk.last_load_source == "disk"
    assert same(got, state(2))


def test_the_saving_process_loads_through_its_own_mapping_a_new_one_with_pread(job, tmp_path):
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    s.save(1, state(1))
    s.save(2, state(2))
    s.wait()
    got = blank()
    # an in-place survivor: its saves filled the mapping's page tables; it copies from it
    assert s.load(got) == 2 and s.last_load_source == "memory"
    assert s.loader.last_memory_read == "mapping"
    assert same(got, state(2))
    got = blank()
    assert s.load(got, step=1) == 1 and s.loader.last_memory_read == "mapping"
    assert same(got, state(1))
    # a non-contiguous live tensor (a transposed view) is read with pread, same bytes
    got = blank()
    got["model"]["h"] = torch.zeros(8, 8).half().t()
    assert not got["model"]["h"].is_contiguous()
    assert s.load(got) == 2 and same(got, state(2))
    s.save(3, state(3))  # the saver still saves after its loads
    s.wait()
    s.close()

    fresh = make_saver(job, d)  # a new process of the rank: its mapping is not filled
    got = blank()
    assert fresh.load(got) == 3 and fresh.loader.last_memory_read == "pread"
    assert same(got, state(3))
    fresh.close()


def test_a_survivor_set_up_again_in_place_loads_through_its_old_savers_mappings(job,
                                                                               tmp_path):
    """A re-setup in place closes the saver with ``close_for_resetup`` (the WorkloadHost
    does, through ``Checkpointer.close(for_resetup=True)``): the next saver of the same
    slots in this process takes its filled mappings and copies from them, where after a
    plain ``close`` it reads with pread (the test above); a saver of other slots does not
    get them."""
    from dlrover_plugin_flashckpt import premap

    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    s.save(1, state(1))
    s.save(2, state(2))
    s.wait()
    try:
        s.close_for_resetup()
        assert sorted(premap._held) == sorted(s.paths)
        again = make_saver(job, d)
        # it finds the persister after its load: the lookup would slow the copy
        assert again._persister_future is None
        got = blank()
        assert again.load(got) == 2 and again.loader.last_memory_read == "mapping"
        assert again._persister_future is not None
        assert same(got, state(2))
        again.save(3, state(3))      # it saves through them as its own
        again.wait()
        again.close_for_resetup()
        other = make_saver(job, str(tmp_path / "other"))   # another directory's slots
        assert premap._held == {}                          # it dropped the handed-over ones
        other.close()
        plain = make_saver(job, d)
        assert plain._persister_future is not None   # no mappings: looked up at once
        got = blank()
        assert plain.load(got) == 3 and plain.loader.last_memory_read == "pread"
        assert same(got, state(3))
        plain.close()
    finally:
        premap.settle([])


def test_a_standby_premaps_the_slots_and_once_promoted_loads_through_the_mapping(job,
                                                                                tmp_path):
    """A warm standby (``prepare_standby``, as a spare's ``prepare()`` calls it) maps the
    role's slots on this node before it knows its rank; promoted (its FlashSaver made),
    it loads through those mappings (a copy) where a new process reads with pread
    (previous test); a slot replaced by a larger save after the premap is mapped again,
    never read stale. The standby is this process: its saver and the rank's saver are
    two objects here, two processes in a job."""
    from dlrover_plugin_flashckpt import premap

    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    s.save(1, state(1))
    s.save(2, state(2))
    s.wait()
    paths = s.paths
    cfg = SaverConfig(dir=d, keep=2, job=job, options={"wait_timeout_s": 60})
    try:
        FlashSaver.prepare_standby(cfg, SaverContext(rank=0, world_size=1))
        p = premap._current
        assert p is not None and sorted(p.mapped) == sorted(paths)   # mapped by the call
        assert all(seg.populated for seg in p.mapped.values())
        # the rank saves a larger state: its slot is laid out again in a new file
        s.save(3, state(3, n=1 << 20))
        s.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with p._lock:
                fresh_maps = all(not seg.replaced() for seg in p.mapped.values())
            if fresh_maps and len(p.mapped) == len(paths):
                break
            time.sleep(0.1)
        assert fresh_maps, "the premapper did not map the replaced slot again"
        s.close()                               # the rank's process died

        promoted = make_saver(job, d)           # the standby becomes rank 0
        assert not p.thread.is_alive()          # it stopped scanning
        assert promoted._persister_future is None   # the lookup waits for the copy
        got = blank(1 << 20)
        assert promoted.load(got) == 3 and promoted.last_load_source == "memory"
        assert promoted._persister_future is not None
        assert promoted.loader.last_memory_read == "mapping"
        assert same(got, state(3, n=1 << 20))
        promoted.close()
    finally:
        premap.settle([])


def test_corrupted_shard_on_disk_is_skipped_for_the_previous_step(job, tmp_path, caplog):
    d = str(tmp_path / "ckpt")
    on_disk_only(job, d, (1, 2))
    with open(os.path.join(d, "step_00000002", "rank_00000.data"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    got = blank()
    with caplog.at_level(logging.WARNING):
        assert make_saver(job, d).load(got) == 1
    assert same(got, state(1))
    assert any("skipping checkpoint step 2" in r.message and "crc32" in r.message
               for r in caplog.records)


def test_persister_killed_mid_persist_leaves_previous_step_loadable(job, tmp_path,
                                                                  monkeypatch):
    """The node's persister is SIGKILLed in the middle of persisting step 2: at the
    crash point after step 2's data file is written, before its fsync and its meta
    file (the second data write of this persister: step 1's was the first). The
    persister is armed through the environment of the process that creates it."""
    d = str(tmp_path / "ckpt")
    n = 1 << 16
    monkeypatch.setenv("DLROVER_CRASHPOINT", "flash.persist.data@2")
    first = make_saver(job, d)
    first.save(1, state(1, n))
    first.wait()
    first.close()
    s = make_saver(job, d)
    persister = s.persister()
    s.save(2, state(2, n))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(persister.status.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break  # killed at the crash point
        time.sleep(0.05)
    else:
        pytest.fail("the persister was not killed at flash.persist.data of step 2")
    monkeypatch.delenv("DLROVER_CRASHPOINT")  # the next persister runs unarmed
    assert s.committed_steps() == [1]
    tmp = os.path.join(d, ".step_00000002.tmp")
    assert [f for f in os.listdir(tmp) if f.endswith(".data")] and not [
        f for f in os.listdir(tmp) if f.endswith((".meta", ".done"))]  # killed mid-persist

    hygiene.remove_job("/dev/shm", job)
    got = blank(n)
    again = make_saver(job, d)
    assert again.load(got) == 1 and again.last_load_source == "disk"
    assert same(got, state(1, n))

    # a new persister takes over; the next commit removes the unfinished directory
    again.save(3, state(3, n))
    again.wait()
    assert again.committed_steps() == [1, 3]
    assert sorted(os.listdir(d)) == ["latest", "lineage.json", "step_00000001", "step_00000003"]


def test_save_never_overwrites_a_buffer_being_persisted(job, tmp_path):
    d = str(tmp_path / "ckpt")
    n = 1 << 20  # 4 MiB at 2 MiB/s: step 2 stays in the persister for a while
    s = make_saver(job, d, throttle_mib_s=2, persist_every_steps=2)
    s.save(2, state(2, n))  # due: slot 0, being persisted
    persister = s.persister()
    deadline = time.monotonic() + 60
    while not (ray.get(persister.status.remote())["current"] or {}).get("bytes"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.save(3, state(3, n))  # not due: the free slot 1
    s.save(4, state(4, n))  # due: may replace step 3 (not waiting for persistence)
    s.save(5, state(5, n))  # not due, slot 1 holds step 4 waiting: skipped, logged
    slots = {seg.read_header().step: shm.effective_state(seg.read_header()) for seg in s.pool.segs}
    assert slots == {2: shm.PERSISTING, 4: shm.READY}
    assert [st for st, _ in s.skipped] == [5]
    assert "being persisted" in s.skipped[0][1]
    s.wait()
    assert s.committed_steps()[-1] == 4
    got = blank(n)
    assert make_saver(job, d).load(got) == 4 and same(got, state(4, n))


def test_buffers_laid_out_once_and_again_when_the_state_changes(job, tmp_path):
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d, slots=1)
    s.save(1, state(1, 100))  # nothing reserved: this save lays the buffer out
    assert s.last_save["laid_out"]
    inode = os.stat(s.paths[0]).st_ino
    s.wait()
    s.save(2, state(2, 100))
    assert os.stat(s.paths[0]).st_ino == inode and not s.last_save["laid_out"]  # reused
    s.wait()
    s.save(3, state(3, 5000))  # bigger tensors: a new buffer
    assert os.stat(s.paths[0]).st_ino != inode and s.last_save["laid_out"]
    got = blank(5000)
    s.wait()
    assert make_saver(job, d, slots=1).load(got) == 3 and same(got, state(3, 5000))


def test_reserve_mib_lays_out_the_buffers_when_the_saver_is_created(job, tmp_path):
    s = make_saver(job, str(tmp_path / "ckpt"), reserve_mib=1)
    s.wait_reserved()
    assert s.last_reserve["data_bytes"] == 1 << 20
    assert all(os.path.getsize(p) >= (1 << 20) for p in s.paths)
    s.save(1, state(1, 200_000))  # 0.8 MiB of tensors: fits
    assert not s.last_save["laid_out"]
    s.save(2, state(2, 400_000))  # 1.6 MiB: lays out its buffer, once
    assert s.last_save["laid_out"]
    s.wait()


def adamw_state(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {"step": 0}}


def test_load_reserves_buffers_for_the_optimizer_state_of_the_first_step(job, tmp_path):
    """A fresh AdamW has no state at load time; the buffers reserved then still hold the
    state after its first step (exp_avg, exp_avg_sq), so no save lays out a buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s = make_saver(job, str(tmp_path / "ckpt"))
    assert s.load(adamw_state(model, opt)) is None  # no checkpoint: reserves in the background
    s.wait_reserved()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert s.last_reserve["data_bytes"] >= 3 * param_bytes
    inodes = [os.stat(p).st_ino for p in s.paths]
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    full = adamw_state(model, opt)
    assert len(full["optimizer"]["state"]) == 4  # the state grew
    for step in (1, 2, 3):
        s.save(step, full)
        assert not s.last_save["laid_out"], step
    assert [os.stat(p).st_ino for p in s.paths] == inodes

    # a state beyond the reservation: one save lays its buffer out, the other grows
    # in the background, and the next save into it is a plain copy again
    big = {**full, "extra": {"step": 0, "big": torch.zeros(4 * param_bytes // 4)}}
    s.save(4, big)
    assert s.last_save["laid_out"]
    s.wait_reserved()  # the other buffer grows once its step is persisted
    s.save(5, big)
    assert not s.last_save["laid_out"]
    s.wait()
    got = {**adamw_state(model, opt), "extra": {"step": -1, "big": torch.ones(param_bytes)}}
    fresh = make_saver(job, str(tmp_path / "ckpt"))
    assert fresh.load(got) == 5 and fresh.last_load_source == "memory"
    assert torch.equal(got["extra"]["big"], big["extra"]["big"])


def test_a_load_from_memory_reserves_the_size_of_the_save_it_restored(job, tmp_path, monkeypatch):
    """After a load that restored a save from the rank's own buffer, the reservation
    takes that save's sizes (the live state has its layout now) instead of building the
    state's table and meta block again on the load's path, unless an optimizer in it
    still lacks state: then the estimate adds that state as before."""
    from dlrover_plugin_flashckpt import capacity

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d)
    s.save(1, adamw_state(model, opt))     # a fresh AdamW: no state yet
    s.wait()
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    s.save(2, adamw_state(model, opt))     # with exp_avg, exp_avg_sq
    s.wait()
    full_data, _ = capacity.estimate(adamw_state(model, opt))

    def no_table(*a, **k):
        raise AssertionError("the state's meta block was built again")

    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    template = adamw_state(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    with monkeypatch.context() as m:
        m.setattr(capacity, "pack_meta", no_table)
        s2 = make_saver(job, d)
        assert s2.load(template) == 2 and s2.last_load_source == "memory"
        s2.wait_reserved()
    assert len(template["optimizer"]["state"]) == 4   # restored into the template
    assert s2.loader.last_layout is not None
    assert s2.last_reserve["data_bytes"] == full_data == s2.loader.last_layout[0]

    # a save whose optimizer had no state yet, loaded from memory: the reservation adds
    # what AdamW's first step creates (the estimate is made, as for a load that found
    # nothing)
    d3 = str(tmp_path / "ckpt3")
    s = make_saver(job, d3)
    s.save(1, adamw_state(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3)))
    s.wait()
    template = adamw_state(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    s3 = make_saver(job, d3)
    assert s3.load(template) == 1 and s3.last_load_source == "memory"
    s3.wait_reserved()
    assert s3.loader.last_layout[0] < 3 * param_bytes
    assert s3.last_reserve["data_bytes"] >= 3 * param_bytes
    s2.close()
    s3.close()


def test_verify_memory_data_catches_corrupted_memory_and_falls_back_to_disk(job, tmp_path,
                                                                            caplog):
    d = str(tmp_path / "ckpt")
    s = make_saver(job, d, verify_memory="data")
    s.save(1, state(1))
    s.wait()  # the persister records the crc32 of the data it wrote
    seg = shm.Segment.attach(s.paths[0])
    h = seg.read_header()
    assert h.crc_seq == h.seq and h.step == 1
    seg.mm[h.data_offset + 10] ^= 0xFF  # a flipped bit in memory
    seg.close()
    got = blank()
    fresh = make_saver(job, d, verify_memory="data")
    with caplog.at_level(logging.WARNING):
        assert fresh.load(got) == 1
    assert fresh.last_load_source == "disk" and same(got, state(1))
    assert any("crc32 of the data" in r.message for r in caplog.records)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_step_is_quarantined_and_a_lower_save_is_persisted(job, tmp_path,
                                                                           damage):
    """Step 300's shard is damaged from outside (cut short, or one byte flipped: only
    its crc32 tells). The load falls back to 200 and step 300 ends up as
    ``step_00000300.corrupt``; a save of 210 is then persisted and reported persisted
    truthfully (it is on disk, ``latest`` names it), and ``keep=1`` keeps it."""
    d = str(tmp_path / "ckpt")
    on_disk_only(job, d, (200, 300))
    shard = os.path.join(d, "step_00000300", "rank_00000.data")
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    else:
        with open(shard, "r+b") as f:
            f.seek(100)
            f.write(bytes([f.read(1)[0] ^ 0xFF]))
    again = FlashSaver(SaverConfig(dir=d, keep=1, job=job, options={"wait_timeout_s": 60}),
                       SaverContext())
    got = blank()
    assert again.load(got) == 200 and again.last_load_source == "disk"
    assert same(got, state(200))
    assert os.path.isdir(os.path.join(d, "step_00000300.corrupt"))
    # what ODL's trainer asks before it acknowledges stream entries: not step 300
    assert again.committed_steps() == [200]
    again.save(210, state(210))
    again.wait()
    assert ray.get(again.persister().flush.remote("", 210)) == 210
    assert again.committed_steps() == [210]
    assert sorted(os.listdir(d)) == ["latest", "lineage.json", "step_00000210",
                                     "step_00000300.corrupt"]
    assert open(os.path.join(d, "latest")).read().strip() == "210"
    hygiene.remove_job("/dev/shm", job)
    got = blank()
    assert make_saver(job, d).load(got) == 210 and same(got, state(210))


def test_load_raises_when_committed_steps_exist_but_none_loads(job, tmp_path):
    """Every committed step lost its data file (a prune racing the load, an NFS
    glitch): load() raises with each step tried and why, instead of returning None
    (a restart from step 0); the steps are not quarantined (nothing is damaged)."""
    from dlrover_core.checkpoint.manifest import CheckpointLoadError

    d = str(tmp_path / "ckpt")
    on_disk_only(job, d, (1, 2))
    for step in (1, 2):
        os.unlink(os.path.join(d, f"step_{step:08d}", "rank_00000.data"))
    got = blank()
    with pytest.raises(CheckpointLoadError) as e:
        make_saver(job, d).load(got)
    assert sorted(e.value.tried) == [1, 2]
    assert "rank_00000.data is missing" in e.value.tried[2]
    assert not got["model"]["w"].any() and got["extra"]["step"] == -1  # untouched
    assert sorted(n for n in os.listdir(d) if n.startswith("step_")) == [
        "step_00000001", "step_00000002"]


def test_replica_calls_refuse_paths_outside_the_job(job, tmp_path):
    """The persister's replica calls take only this job's checkpoint folder and
    shared-memory names: a caller-chosen path is an error naming it."""
    import numpy as np

    d = str(tmp_path / "ckpt" / "trainer")
    s = make_saver(job, d)
    s.save(1, state(1))
    s.wait()
    p = s.persister()
    info = {"dir": d, "role": "trainer", "rank": 0, "world_size": 1, "step": 1,
            "meta": b"m", "data_len": 4, "shm_dir": "/dev/shm"}
    data = np.zeros(4, dtype=np.uint8)
    with pytest.raises(ValueError, match="'/tmp' is not allowed"):
        ray.get(p.store_replica.remote({**info, "shm_dir": "/tmp"}, data))
    with pytest.raises(ValueError, match="checkpoint dir '/etc' is not this job's"):
        ray.get(p.store_replica.remote({**info, "dir": "/etc"}, data))
    with pytest.raises(ValueError, match="'/etc/passwd' is not in an allowed"):
        ray.get(p.read_replica.remote("/etc/passwd", 1))
    with pytest.raises(ValueError, match="is not a replica buffer of this job"):
        ray.get(p.read_replica.remote(s.paths[0], 1))  # a slot, not a replica
    with pytest.raises(ValueError, match="'/tmp' is not allowed"):
        ray.get(p.replicas.remote(d, "/tmp"))
    assert ray.get(p.replicas.remote(d))["held"] == []
    # a sibling role's folder of the same job is allowed
    name = ray.get(p.store_replica.remote({**info, "dir": str(tmp_path / "ckpt" / "other")},
                                          data))
    assert name.startswith(shm.job_prefix(job))


def test_saves_after_a_heal_find_their_buffers_laid_out(job, tmp_path):
    """A rank healed from a survivor's live state (``Checkpointer.load`` with a heal)
    never calls the saver's load, which lays out the buffers; the checkpointer asks the
    saver to (``reserve_for``) so that its first saves copy into ready buffers. The heal
    here is a function that fills the objects and returns the step, as
    ``dlrover_core.checkpoint.heal.heal`` does over a process group."""
    from dlrover_core.checkpoint.checkpointer import Checkpointer

    def heal(objects: dict) -> int:
        objects["model"].update(state(7)["model"])
        return 7

    for healed in (True, False):
        s = make_saver(job, str(tmp_path / f"ckpt-{healed}"))
        ck = Checkpointer(saver=s, every_steps=1, heal=heal if healed else None)
        objects = {"model": blank()["model"]}
        assert ck.load(**objects) == (7 if healed else None)
        s.wait_reserved()
        ck.save(8, **objects)
        # without the heal the saver's own load (nothing found) reserved them as well
        assert not s.last_save["laid_out"], (healed, s.last_save)
        ck.save(9, **objects)
        assert not s.last_save["laid_out"], (healed, s.last_save)
        # committed before the next saver registers the same role and rank with another
        # folder (that registration replaces this one: a step of it still persisting
        # then stays uncommitted, and the job's end keeps its buffer)
        s.wait()
        s.close()


def test_replicas_go_over_one_kept_connection_and_a_replaced_holder_gets_a_new_one(
        job, tmp_path):
    """The replica sender's TCP path (``ReplicaSender._send_over_tcp``, here in the
    driver: the source) against a real persister actor as the holder (on this one-node
    cluster a second persister actor, unnamed, stands for the peer node's). Two saves
    go over one connection: only the first pays for opening it (``connect_s`` 0 after).
    The holder is killed (``ray.kill``) and replaced: the next save finds the kept
    connection broken, opens one to the new holder, and lands there bit for bit."""
    from dlrover_plugin_flashckpt import replica
    from dlrover_plugin_flashckpt.node_ranks import NodeRanks
    from dlrover_plugin_flashckpt.persister import remote_class

    HOLDER_NODE = "0fedcba987654321"   # hex, as Ray's node ids: in the replicas' names
    holders: list = []

    def new_holder():
        h = remote_class().options(num_cpus=0, max_concurrency=16).remote(
            job, hygiene.current_session(), HOLDER_NODE, "/dev/shm")
        ray.get(h.ready.remote(), timeout=60)
        holders.append(h)
        return h

    d = str(tmp_path / "ckpt" / "trainer")
    s = make_saver(job, d)
    sender = replica.ReplicaSender(NodeRanks(job, os.getpid(), 0), "source-node",
                                   lambda node: holders[-1], lambda e: None)
    new_holder()
    timings, got = [], []
    try:
        for step in (1, 2, 3):
            if step == 3:   # the holder's process dies; another takes its place
                old = holders[-1]
                ray.kill(old)
                # the kill is asynchronous: a call may still be served until it lands
                deadline = time.monotonic() + 60
                while True:
                    try:
                        ray.get(old.ready.remote(), timeout=60)
                    except ray.exceptions.RayActorError:
                        break
                    assert time.monotonic() < deadline, "the killed holder still answers"
                    time.sleep(0.1)
                new_holder()
            s.save(step, state(step))
            segs = [g for g in (shm.Segment.attach(p) for p in s.paths) if g is not None]
            [seg] = [g for g in segs if g.read_header().step == step]
            for g in segs:
                if g is not seg:
                    g.close()
            h = seg.read_header()
            info = {"dir": d, "role": "trainer", "rank": 0, "world_size": 1, "step": step,
                    "meta": seg.meta_bytes(h), "data_len": h.data_len,
                    "saved_at": h.saved_at, "run_id": "", "shm_dir": "/dev/shm",
                    "source": "source-node"}
            t: dict = {}
            name = sender._send_over_tcp(HOLDER_NODE, info, seg, h, t)
            timings.append(t)
            held = ray.get(holders[-1].replicas.remote(d))["held"]
            [rep] = [x for x in held if x["step"] == step]
            assert name == rep["name"]
            back = ray.get(holders[-1].read_replica.remote(rep["path"], step))
            got.append(back["data"].tobytes() == bytes(seg.data_view(h))
                       and back["meta"] == info["meta"])
            seg.close()
        assert got == [True, True, True]
        assert timings[0]["connect_s"] > 0 and timings[2]["connect_s"] > 0
        assert timings[1]["connect_s"] == 0.0   # the connection of step 1, kept
        assert len(sender._links) == 1
    finally:
        for link in sender._links.values():
            link.close()
        s.close()
        for h in holders:
            ray.kill(h)
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            if path.endswith(f"-n{HOLDER_NODE[:12]}"):
                os.unlink(path)   # the unnamed holders' replicas: finish_job sees none
