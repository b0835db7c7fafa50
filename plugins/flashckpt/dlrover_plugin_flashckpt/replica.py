"""Replicas of a node's saves in a peer node's memory (``checkpoint.options.replicas``).

The in-memory redundancy of Gemini (Wang et al., "GEMINI: Fast Failure Recovery in
Distributed Training with In-Memory Checkpoints", SOSP '23): after a save, each
node's persister copies its ranks' newest saves into the memory of the next node of
the ring (alive Ray nodes sorted by id), asynchronously, so a job that loses a whole
node restores the newest saved step from the peer's memory instead of the newest
persisted one from disk.

On the holder, a replica is a buffer of the same format as a slot (:mod:`.shm`),
named ``dlrflash-<job>-<dir digest>-r<rank>-p<k>-n<holder node>``, two per source
rank (one is written while the other keeps the previous step), READY with the step,
the meta block and its crc32. Imports no torch.

Transfer: the source persister maps its slot, puts the data area into the Ray object
store (one copy), checks that the slot's sequence number did not move meanwhile (a
save overwrote it: the replica is dropped), and calls the holder's persister, which
receives the bytes through Ray's object transfer and copies them into its buffer.
A trainer reads a replica on its own node by path, and one on another node through
the holder's persister (:func:`read_replica` returns the bytes as a Ray object).
"""

from __future__ import annotations

import os
import re
import time
import zlib
from typing import Any

from dlrover_plugin_flashckpt import shm

#: replica buffers per source rank on a holder
REPLICA_SLOTS = 2

_REPLICA_RE = re.compile(r"-r(\d{5})-p(\d+)-n([0-9a-f]+)$")


def replica_name(job: str, directory: str, rank: int, k: int, holder: str) -> str:
    return f"{shm.job_prefix(job)}{shm.dir_key(directory)}-r{rank:05d}-p{k}-n{holder[:12]}"


def parse_replica(name: str) -> tuple[int, int, str] | None:
    """``(rank, k, holder node prefix)`` of a replica buffer name, else ``None``."""
    m = _REPLICA_RE.search(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def peer_of(node_id: str, alive: list[str]) -> str | None:
    """The node after ``node_id`` in the ring of ``alive`` nodes (sorted), or ``None``
    when there is no other node."""
    ring = sorted(set(alive) | {node_id})
    if len(ring) < 2:
        return None
    return ring[(ring.index(node_id) + 1) % len(ring)]


def store(shm_dir: str, job: str, holder: str, info: dict, data: Any, ident: dict) -> str:
    """Write one replica on the holder: ``info`` (``dir``, ``rank``, ``world_size``,
    ``step``, ``meta`` bytes, ``data_len``) and ``data`` (a buffer of ``data_len``
    bytes). Takes the replica buffer of this rank that does not hold the newest step,
    grows it when too small. Returns its name.

    Raises:
        ShmSpaceError: too little shared memory on the holder.
        ValueError: ``data`` is not ``data_len`` bytes.
    """
    view = memoryview(data).cast("B")
    n, meta = int(info["data_len"]), bytes(info["meta"])
    if len(view) != n:
        raise ValueError(f"replica of rank {info['rank']} step {info['step']}: {len(view)} "
                         f"bytes received, {n} expected")
    paths = [os.path.join(shm_dir, replica_name(job, info["dir"], info["rank"], k, holder))
             for k in range(REPLICA_SLOTS)]
    segs = [shm.Segment.attach(p) for p in paths]
    try:
        def rank_of(seg: shm.Segment | None) -> tuple[int, int]:
            if seg is None:
                return (-2, 0)
            h = seg.read_header()
            return (h.step if h.state == shm.READY else -1, h.seq)

        k = min(range(REPLICA_SLOTS), key=lambda i: rank_of(segs[i]))
        seg = segs[k]
        meta_need = max(64 << 10, 2 * len(meta))
        if seg is None or seg.data_cap < n or seg.read_header().meta_cap < len(meta):
            if seg is not None:
                seg.close()
            seg = segs[k] = shm.Segment.create(paths[k], meta_need, n + n // 8, ident, bytes(16),
                                               int(info["rank"]), int(info["world_size"]))
        with seg.locked():
            h = seg.read_header()
            h.state, h.seq = shm.WRITING, h.seq + 1
            h.writer_pid, h.writer_start = shm.my_identity()
            seg.write_header(h)
        seg.mm[h.data_offset:h.data_offset + n] = view
        seg.write_meta(meta)
        with seg.locked():
            h = seg.read_header()
            h.step, h.state, h.due = int(info["step"]), shm.READY, 0
            h.meta_len, h.meta_crc = len(meta), zlib.crc32(meta)
            h.data_len, h.saved_at = n, float(info.get("saved_at", time.time()))
            h.rank, h.world_size = int(info["rank"]), int(info["world_size"])
            h.persister_pid, h.persister_start = shm.my_identity()
            seg.write_header(h)
        return seg.name
    finally:
        for s in segs:
            if s is not None:
                s.close()


def held(shm_dir: str, job: str, directory: str, holder: str) -> list[dict]:
    """The complete replicas of ``directory`` this holder has: ``[{"name", "rank",
    "world_size", "step", "bytes"}]``."""
    prefix = f"{shm.job_prefix(job)}{shm.dir_key(directory)}-r"
    out = []
    for path in shm.list_segments(shm_dir, prefix):
        parsed = parse_replica(os.path.basename(path))
        if parsed is None or not holder.startswith(parsed[2]):
            continue
        seg = shm.Segment.attach(path)
        if seg is None:
            continue
        try:
            h = seg.read_header()
            if h.state == shm.READY and h.step >= 0 and seg.ident().get("dir") == directory:
                out.append({"name": seg.name, "rank": h.rank, "world_size": h.world_size,
                            "step": h.step, "bytes": h.data_len, "path": path})
        finally:
            seg.close()
    return out


def open_step(path: str, step: int) -> tuple[shm.Segment, shm.Header, bytes]:
    """``(segment, header, meta block)`` of the replica at ``path`` holding ``step``,
    its meta block checked against its crc32. The caller reads the data, checks that
    ``segment.read_header().seq`` is still ``header.seq``, and closes the segment.

    Raises:
        ValueError: the replica is gone, holds another step, or its meta block is
            damaged.
    """
    seg = shm.Segment.attach(path)
    if seg is None:
        raise ValueError(f"replica {os.path.basename(path)} is gone")
    try:
        with seg.locked():
            h = seg.read_header()
            if h.state != shm.READY or h.step != step:
                raise ValueError(f"replica {seg.name} holds step {h.step}, not {step}")
            meta = seg.meta_bytes(h)
        if zlib.crc32(meta) != h.meta_crc:
            raise ValueError(f"replica {seg.name}: crc32 of the meta block does not match")
    except BaseException:
        seg.close()
        raise
    return seg, h, meta


def read(path: str, step: int) -> dict:
    """``{"meta": bytes, "data": numpy uint8 array (a copy), "step"}`` of a replica.

    Raises:
        ValueError: it no longer holds ``step``, or changed while it was read.
    """
    import numpy as np

    seg, h, meta = open_step(path, step)
    try:
        data = np.frombuffer(seg.mm, dtype=np.uint8, count=h.data_len, offset=h.data_offset).copy()
        if seg.read_header().seq != h.seq:
            raise ValueError(f"replica {seg.name} was overwritten while it was read")
        return {"meta": meta, "data": data, "step": step}
    finally:
        seg.close()
