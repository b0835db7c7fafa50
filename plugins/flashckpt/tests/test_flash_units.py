"""Options, layout, shared-memory buffers and the on-disk commit, without Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt import hygiene, layout, shm, storage
from dlrover_plugin_flashckpt.options import FlashOptions


# ----------------------------------------------------------------------------- options
def test_options_defaults_and_values():
    o = FlashOptions.parse({"persist_every_steps": 5, "slots": 3, "throttle_mib_s": 10})
    assert (o.persist_every_steps, o.slots, o.throttle_mib_s) == (5, 3, 10.0)
    assert o.is_due(10) and not o.is_due(7)
    assert FlashOptions.parse(None) == FlashOptions()


@pytest.mark.parametrize("options, key, allowed", [
    ({"slot": 2}, "checkpoint.options.slot", "persist_every_steps"),
    ({"slots": 0}, "checkpoint.options.slots", "from 1 to 8"),
    ({"slots": 2.5}, "checkpoint.options.slots", "from 1 to 8"),
    ({"persist_every_steps": "often"}, "checkpoint.options.persist_every_steps", ">= 1"),
    ({"verify_memory": "all"}, "checkpoint.options.verify_memory", "header or data"),
    ({"shm_dir": "shm"}, "checkpoint.options.shm_dir", "absolute"),
    ({"throttle_mib_s": -1}, "checkpoint.options.throttle_mib_s", ">= 0"),
    ({"replica_transport": "udp"}, "checkpoint.options.replica_transport", "tcp or ray"),
])
def test_bad_options_name_key_value_and_allowed(options, key, allowed):
    with pytest.raises(SpecError) as e:
        FlashOptions.parse(options)
    msg = str(e.value)
    assert msg.startswith(key) and repr(next(iter(options.values()))) in msg and allowed in msg


# ----------------------------------------------------------------------------- layout
def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g).to(
            torch.bfloat16), "mask": torch.rand(4, generator=g) > 0.5,
            "t": torch.randn(6, 4, generator=g).t()},  # non-contiguous
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(
            5, 7, generator=g)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95),
                                                     "params": [0]}]},
        "extra": {"step": 3, "rng": torch.get_rng_state(), "empty": torch.empty(0, 3),
                  "pos": ("shard", 17)},
    }


def _pack(state):
    table, sources, skeleton = layout.build_table(state)
    buf = bytearray(layout.data_size(table))
    for e, src in zip(table, sources):
        layout.tensor_view(buf, 0, e).copy_(src)
    return table, skeleton, buf


def test_layout_round_trip_is_bit_exact_and_in_place():
    state = _state()
    table, skeleton, buf = _pack(state)
    assert all(e.offset % layout.ALIGN == 0 for e in table)
    live = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.5, "params": [0]}]},
            "extra": {"step": 0, "rng": torch.zeros_like(state["extra"]["rng"]),
                      "empty": torch.empty(0, 3)}}
    w_before = live["model"]["w"]
    out = layout.restore(live, skeleton, table, lambda e: layout.tensor_view(buf, 0, e), "test")
    assert out is live and live["model"]["w"] is w_before  # same tensor, new bytes
    flat_a = {k: v for k, v in layout.walk(state)}
    flat_b = {k: v for k, v in layout.walk(live)}
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        assert flat_a[k].dtype == flat_b[k].dtype and torch.equal(flat_a[k], flat_b[k]), k
    assert live["extra"]["step"] == 3 and live["extra"]["pos"] == ("shard", 17)
    assert live["optimizer"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.95),
                                                     "params": [0]}


def test_layout_mismatch_names_the_tensor():
    state = _state()
    table, skeleton, buf = _pack(state)
    live = _state()
    live["model"]["w"] = torch.zeros(4, 7)
    with pytest.raises(layout.LayoutError, match=r"model\.w is float32\[5, 7\].*\[4, 7\]"):
        layout.restore(live, skeleton, table, lambda e: layout.tensor_view(buf, 0, e), "x")
    live = _state()
    live["model"]["new"] = torch.zeros(2)
    with pytest.raises(layout.LayoutError, match=r"no tensor at model\.new"):
        layout.restore(live, skeleton, table, lambda e: layout.tensor_view(buf, 0, e), "x")


def test_layout_rejects_sparse_tensors():
    with pytest.raises(TypeError, match="model.s"):
        layout.build_table({"model": {"s": torch.eye(3).to_sparse()}})


def test_signature_changes_with_shapes():
    a = layout.build_table({"w": torch.zeros(3)})[0]
    b = layout.build_table({"w": torch.zeros(4)})[0]
    assert layout.signature(a) != layout.signature(b)
    assert layout.signature(a) == layout.signature(layout.build_table({"w": torch.ones(3)})[0])


# ----------------------------------------------------------------------------- shm
@pytest.fixture
def shm_path(request):
    path = f"/dev/shm/{shm.NAME_PREFIX}unit-{os.getpid()}-{request.node.name[:30]}"
    yield path
    for p in shm.list_segments("/dev/shm", os.path.basename(path)):
        os.unlink(p)


def test_segment_header_and_ident_round_trip(shm_path):
    seg = shm.Segment.create(shm_path, 100, 1000, {"job": "j", "dir": "/x"}, b"s" * 16, 1, 2)
    assert os.path.getsize(shm_path) == shm.HEADER_SIZE + 4096 + 4096
    other = shm.Segment.attach(shm_path)
    h = seg.read_header()
    assert (h.state, h.rank, h.world_size, h.sig, h.writer_pid) == (
        shm.EMPTY, 1, 2, b"s" * 16, os.getpid())
    with seg.locked():
        h.state, h.step, h.seq = shm.READY, 7, 3
        seg.write_header(h)
    assert other.read_header().step == 7 and other.ident() == {"job": "j", "dir": "/x"}
    assert shm.holds_step(other.read_header())
    seg.close()
    other.close()


def test_claim_of_a_dead_persister_is_void(shm_path):
    seg = shm.Segment.create(shm_path, 100, 100, {}, b"\0" * 16, 0, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    h = seg.read_header()
    h.state, h.step, h.persister_pid, h.persister_start = shm.PERSISTING, 4, pid, 12345
    seg.write_header(h)
    assert shm.effective_state(seg.read_header()) == shm.READY
    h.persister_pid, h.persister_start = shm.my_identity()
    seg.write_header(h)
    assert shm.effective_state(seg.read_header()) == shm.PERSISTING
    seg.close()


def test_a_resized_rank_never_persists_or_replicates_the_old_worlds_save(shm_path):
    """A slot's name has no world size: after 2 ranks shrink to 1, rank 0's buffer still
    holds the 2-rank save of step 3 (half the shards). The persister of the 1-rank
    registration must not take it as its own (it would commit half a model as world 1,
    or replicate it labelled world 1); the 2-rank registration still sees it."""
    from dlrover_plugin_flashckpt.node_ranks import NodeRanks
    from dlrover_plugin_flashckpt.persisting import PersistLoop, Registration

    seg = shm.Segment.create(shm_path, 100, 100, {"job": "j", "dir": "/x"}, b"\0" * 16, 0, 2)
    with seg.locked():
        h = seg.read_header()
        h.state, h.step, h.seq = shm.READY, 3, 1
        seg.write_header(h)

    ranks = NodeRanks("j", *shm.my_identity())
    old = Registration(role="trainer", rank=0, world_size=2, dir="/x", keep=2,
                       slots=[shm_path])
    new = Registration(role="trainer", rank=0, world_size=1, dir="/x", keep=2,
                       slots=[shm_path])
    assert set(ranks.rank_steps(old, pending_only=True)) == {3}
    assert ranks.rank_steps(new, pending_only=False) == {}
    assert ranks.pending([new], 3) is None
    ranks.register(new)
    assert PersistLoop(ranks).claim("trainer", 3) == []  # its thread is not started
    assert seg.read_header().state == shm.READY  # not claimed for persistence
    ranks.close_all()
    seg.close()


def test_too_small_shm_says_needed_and_free():
    free = shm.shm_free_bytes("/dev/shm")
    with pytest.raises(shm.ShmSpaceError) as e:
        shm.check_space("/dev/shm", free + (5 << 30), "2 buffers of trainer rank 0")
    msg = str(e.value)
    assert "needs" in msg and "GiB" in msg and "free" in msg and "slots=1" in msg
    assert f"{(free + (5 << 30)) / 2**30:.2f} GiB" in msg


def test_stale_buffers_of_dead_processes_are_removed(shm_path):
    # a buffer written by a process that is gone (no job master, no persister)
    code = (f"from dlrover_plugin_flashckpt import shm; "
            f"shm.Segment.create({shm_path!r}, 10, 10, {{'job': 'gone'}}, bytes(16), 0, 1)")
    subprocess.run([sys.executable, "-c", code], check=True)
    live = shm.Segment.create(shm_path + "-live", 10, 10, {"job": "here"}, bytes(16), 0, 1)
    reason = hygiene.stale_reason(shm_path, "")
    assert reason and "gone" in reason
    assert hygiene.stale_reason(shm_path + "-live", "") is None
    removed = hygiene.remove_stale("/dev/shm", "", prefix=os.path.basename(shm_path))
    assert os.path.basename(shm_path) in removed and not os.path.exists(shm_path)
    assert os.path.exists(shm_path + "-live")
    live.close()


# ----------------------------------------------------------------------------- storage
def _write(directory, step, world, payload=b"x" * 1000):
    for r in range(world):
        storage.write_shard(directory, step, r, world, b"meta%d" % r, memoryview(payload))


def test_commit_needs_every_rank_and_is_verified(tmp_path):
    d = str(tmp_path)
    storage.write_shard(d, 5, 0, 2, b"m", memoryview(b"a" * 100))
    assert not storage.try_commit(d, 5, 2, keep=2)
    assert storage.newest_committed(d) is None and storage.pending_tmp_steps(d) == [5]
    storage.write_shard(d, 5, 1, 2, b"m", memoryview(b"b" * 100))
    assert storage.try_commit(d, 5, 2, keep=2)
    step_dir = os.path.join(d, "step_00000005")
    manifest = storage.verify_step(step_dir)
    assert manifest["world_size"] == 2 and set(manifest["files"]) == {
        "rank_00000.data", "rank_00000.meta", "rank_00001.data", "rank_00001.meta"}
    assert sorted(os.listdir(step_dir)) == sorted(list(manifest["files"]) + ["manifest.json"])
    assert open(os.path.join(d, "latest")).read().strip() == "5"
    with open(os.path.join(step_dir, "rank_00001.data"), "r+b") as f:
        f.write(b"c")
    storage.verify_step(step_dir, ranks=[0])
    with pytest.raises(CorruptCheckpointError, match="rank_00001.data crc32"):
        storage.verify_step(step_dir, ranks=[1])
    with pytest.raises(CorruptCheckpointError, match="world_size 2"):
        storage.verify_step(step_dir, world_size=4)


def test_commit_prunes_and_drops_older_unfinished_steps(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3):
        _write(d, step, 1)
        assert storage.try_commit(d, step, 1, keep=2)
    storage.write_shard(d, 4, 0, 2, b"m", memoryview(b"a"))  # rank 1 never comes
    _write(d, 5, 1)
    assert storage.try_commit(d, 5, 1, keep=2)
    assert storage.newest_committed(d) == 5
    assert sorted(os.listdir(d)) == ["latest", "step_00000003", "step_00000005"]
    _write(d, 4, 1)  # an older step finishing late is dropped, not committed
    assert not storage.try_commit(d, 4, 1, keep=2)
    assert json.loads(open(os.path.join(d, "step_00000005", "manifest.json")).read())["step"] == 5


def test_cli_lists_and_cleans_stale_buffers(shm_path, capsys):
    from dlrover_core.cli.main import main

    code = (f"from dlrover_plugin_flashckpt import shm; "
            f"shm.Segment.create({shm_path!r}, 10, 10, {{'job': 'gone', 'role': 't'}}, "
            f"bytes(16), 3, 4)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert main(["flash", "ls", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)
            if r["name"] == os.path.basename(shm_path)]
    assert rows == [{"name": os.path.basename(shm_path), "job": "gone", "role": "t", "rank": 3,
                     "step": -1, "state": "empty", "bytes": os.path.getsize(shm_path),
                     "session": None, "run_id": None}]
    assert main(["flash", "clean"]) == 0
    assert f"removed {os.path.basename(shm_path)}" in capsys.readouterr().out
    assert not os.path.exists(shm_path)


def _flash_spec(*options: str):
    """examples/nanogpt/job.yaml with the flash saver and ``checkpoint.options.<KEY=VALUE>``
    overrides, through ``load_spec``."""
    from dlrover_core import load_spec

    return load_spec("examples/nanogpt/job.yaml",
                     ["checkpoint.saver=flash", *(f"checkpoint.options.{o}" for o in options)])


@pytest.mark.parametrize("option,match", [
    ("slots=0", r"checkpoint\.options\.slots"),
    ("bogus=1", r"checkpoint\.options\.bogus"),
    ("replicas=2", r"checkpoint\.options\.replicas.*2.*0 \(no replica\)"),
])
def test_bad_options_fail_when_the_spec_loads(option, match):
    """checkpoint.options are checked by load_spec, before anything starts."""
    from dlrover_core import SpecError

    with pytest.raises(SpecError, match=match):
        _flash_spec(option)


def test_good_options_reach_the_spec():
    options = _flash_spec("slots=3", "replicas=1").checkpoint.options
    assert (options.slots, options.replicas) == (3, 1)


# ----------------------------------------------------------------------------- reader
def test_shard_reader_reads_into_live_tensors_in_place(tmp_path):
    from dlrover_plugin_flashckpt.reader import INLINE_MAX, ShardReader

    big = torch.randn(INLINE_MAX // 4 * 3)  # split over the reader's threads
    small = torch.arange(10, dtype=torch.int16)
    path = tmp_path / "data"
    path.write_bytes(b"\0" * 100 + big.numpy().tobytes() + small.numpy().tobytes())
    dst_big, dst_small = torch.zeros_like(big), torch.zeros(5, 2, dtype=torch.int16).t()
    with ShardReader(str(path), base=100) as rd:
        rd.submit(dst_big, 0)
        rd.submit(dst_small, big.numel() * 4)  # non-contiguous: through a temporary
        rd.drain()
        assert torch.equal(dst_big, big)
        assert torch.equal(dst_small, small.view(2, 5))  # bytes in dst's logical order
        with pytest.raises(OSError, match="missing"):
            rd.read_into(torch.zeros(4), big.numel() * 4 + 16)  # past the end


def test_copies_from_a_mapping_split_over_threads_are_bit_for_bit(tmp_path, monkeypatch):
    """A warm load's copies (copy_from) are cut in pieces that the calling thread and
    the reader's threads take; every byte lands once, as the tensor's own dtype (NaN
    payloads kept), and the mapping can be closed after drain()."""
    import mmap

    from dlrover_plugin_flashckpt import reader
    from dlrover_plugin_flashckpt.reader import COPY_PIECE, ShardReader

    monkeypatch.setattr(reader, "reader_threads", lambda: 3)  # 2 copiers even on 1 core
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(5 * COPY_PIECE // 4 + 3, generator=g),             # float32
            torch.randint(-9, 9, (COPY_PIECE // 8 * 3 + 1,), generator=g),  # int64
            torch.randn(1001, generator=g).to(torch.bfloat16),
            torch.arange(333, dtype=torch.uint8),
            torch.empty(0),
            torch.full((3 * COPY_PIECE // 4,), float("nan")).view(torch.int32).add_(7)
            .view(torch.float32)]                                           # NaN payloads
    blob = b"".join(s.view(torch.uint8).numpy().tobytes() for s in srcs)
    path = tmp_path / "buf"
    path.write_bytes(b"\1" * 4096 + blob)
    dsts = [torch.zeros_like(s) for s in srcs]
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    with ShardReader(str(path)) as rd:
        off = 4096
        for d in dsts:
            rd.copy_from(d, mm, off)
            off += d.numel() * d.element_size()
        assert len(rd._copiers) >= 2  # the pool's copiers started as the pieces came
        rd.drain()
    mm.close()  # no view of the mapping is left
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))


def test_a_failed_copy_from_a_mapping_raises_at_drain(tmp_path):
    import mmap

    from dlrover_plugin_flashckpt.reader import COPY_PARALLEL_MIN, ShardReader

    path = tmp_path / "buf"  # the second copy reads past its end
    path.write_bytes(b"\0" * COPY_PARALLEL_MIN)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    with ShardReader(str(path)) as rd:
        rd.copy_from(torch.zeros(COPY_PARALLEL_MIN // 8), mm, 0)
        rd.copy_from(torch.zeros(COPY_PARALLEL_MIN // 4), mm, COPY_PARALLEL_MIN // 2)  # past
        with pytest.raises(ValueError):
            rd.drain()
    mm.close()


# ----------------------------------------------------------------------------- reshard
def _shards(full: torch.Tensor, world: int) -> list[tuple[torch.Tensor, tuple]]:
    """``Shard(0)`` of ``full`` over ``world`` ranks as FSDP2 lays it out
    (``torch.chunk``): (local tensor, global offset) per rank."""
    out, row = [], 0
    for r in range(world):
        part = torch.chunk(full, world)[r] if r < len(torch.chunk(full, world)) \
            else full[:0]
        out.append((part.clone(), (row,) + (0,) * (full.dim() - 1)))
        row += part.shape[0]
    return out


def test_reshard_places_saved_shards_into_another_world_size():
    from dlrover_plugin_flashckpt.reshard import RankSource, restore_resharded

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(5, 3, generator=g), torch.randn(7, generator=g)
    sources = []
    for r, ((wl, wo), (bl, bo)) in enumerate(zip(_shards(w, 2), _shards(b, 2))):
        state = {"model": {"w": wl, "b": bl}, "extra": {"rank": r, "rng": torch.tensor([r])}}
        table, tensors, skeleton = layout.build_table(state)
        table = [layout.TensorEntry(e.path, e.dtype, e.shape, e.offset, e.nbytes, "dtensor",
                                    tuple(full.shape), off)
                 if e.path[0] == "model" else e
                 for e, (full, off) in zip(table, [(w, wo), (b, bo), (None, None),
                                                   (None, None)])]
        buf = bytearray(layout.data_size(table))
        for e, t in zip(table, tensors):
            layout.tensor_view(buf, 0, e).copy_(t)
        sources.append(RankSource(r, {"table": table, "skeleton": skeleton},
                                  lambda e, off, dst, buf=buf: dst.view(-1).copy_(
                                      torch.frombuffer(buf, dtype=torch.uint8,
                                                       count=dst.numel() * dst.element_size(),
                                                       offset=e.offset + off)
                                      .view(dst.dtype))))
    # into one rank: plain live tensors are whole global tensors
    live = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(7)}, "extra": {}}
    restore_resharded(live, sources, 0, "test")
    assert torch.equal(live["model"]["w"], w) and torch.equal(live["model"]["b"], b)
    assert live["extra"] == {"rank": 0, "rng": torch.tensor([0])}
    # a live tensor of another global shape is refused, naming it
    bad = {"model": {"w": torch.zeros(6, 3), "b": torch.zeros(7)}, "extra": {}}
    with pytest.raises(layout.LayoutError, match=r"model\.w has global shape \[5, 3\]"):
        restore_resharded(bad, sources, 0, "test")
    # a saved shard missing: the live tensor is not covered
    with pytest.raises(layout.LayoutError, match="are not all ranks"):
        restore_resharded(live, sources[1:], 0, "test")


def test_shard_region_is_torchs_local_shape_and_global_offset():
    """layout.shard_region against torch's own ``_compute_local_shape_and_global_offset``
    (plain data, no process group) at every coordinate of 1-D and 2-D meshes, even and
    uneven splits, empty shards, nested shards of one dim; a ``_StridedShard`` is left
    to torch (``None``)."""
    from itertools import product

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = {(3,): [[Shard(0)], [Replicate()], [Shard(1)]],
               (2, 3): [[Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)],
                        [Replicate(), Shard(0)], [Shard(1), Partial()]]}
    shapes = [(7, 5), (2, 9), (1, 1), (12, 4), (0, 3)]
    checked = 0
    for mesh_shape, placement_sets in layouts.items():
        for placements, shape in product(placement_sets, shapes):
            for coord in product(*(range(n) for n in mesh_shape)):
                want = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord),
                                                              placements)
                got = layout.shard_region(shape, mesh_shape, list(coord), placements)
                assert got == (tuple(want[0]), tuple(int(o) for o in want[1])), \
                    (mesh_shape, placements, shape, coord, got, want)
                checked += 1
    assert checked == 5 * (3 * 3 + 5 * 6)
    strided = [_StridedShard(0, split_factor=2), Shard(0)]
    assert layout.shard_region((8, 2), (2, 2), [0, 1], strided) is None
