"""The replica buffers of a checkpoint folder in a node's shared memory, by name and
header: write one (:func:`store`, on the holder), list them (:func:`folder_buffers`,
:func:`held`), name the attempt of the save one holds (:func:`buffer_tag_at`), and read
one (:func:`open_step`, :func:`read`). Imports no torch. Who sends and holds the copies
is :mod:`.replica`'s.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from typing import Any, Callable, Iterator

from dlrover_plugin_flashckpt import shm

#: replica buffers per source rank on a holder
REPLICA_SLOTS = 2


def replica_name(job: str, directory: str, rank: int, k: int, holder: str) -> str:
    return f"{shm.job_prefix(job)}{shm.dir_key(directory)}-r{rank:05d}-p{k}-n{holder[:12]}"


_REPLICA_RE = re.compile(r"-r(\d{5})-p(\d+)-n([0-9a-f]+)$")


def parse_replica(name: str) -> tuple[int, int, str] | None:
    """``(rank, k, holder node prefix)`` of a replica buffer name, else ``None``."""
    m = _REPLICA_RE.search(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def folder_buffers(shm_dir: str, job: str, directory: str,
                   wanted: Callable[[str], bool]) -> Iterator[tuple[str, shm.Header]]:
    """``(path, header)`` of each buffer of ``job`` in ``shm_dir`` named for the
    checkpoint folder ``directory`` (its slots and the replicas of its saves) whose file
    name passes ``wanted`` and whose identity names ``directory``; each buffer is
    unmapped before its pair is yielded, a missing one skipped.

    Raises:
        shm.ShmTrustError: a buffer is not this user's own (see ``Segment.attach``).
    """
    prefix = f"{shm.job_prefix(job)}{shm.dir_key(directory)}-r"
    for path in shm.list_segments(shm_dir, prefix):
        if not wanted(os.path.basename(path)):
            continue
        seg = shm.Segment.attach(path)
        if seg is None:
            continue
        try:
            h, ours = seg.read_header(), seg.ident().get("dir") == directory
        finally:
            seg.close()
        if ours:
            yield path, h


def held(shm_dir: str, job: str, directory: str, holder: str) -> list[dict]:
    """The complete replicas of ``directory`` this holder has: ``[{"name", "rank",
    "world_size", "step", "tag", "bytes", "path"}]`` (``tag``: the attempt tag of the
    save, :func:`.choice.buffer_tag`)."""

    def mine(name: str) -> bool:
        parsed = parse_replica(name)
        return parsed is not None and holder.startswith(parsed[2])

    return [{"name": os.path.basename(path), "rank": h.rank, "world_size": h.world_size,
             "step": h.step, "tag": buffer_tag_at(path, h), "bytes": h.data_len,
             "path": path}
            for path, h in folder_buffers(shm_dir, job, directory, mine)
            if h.state == shm.READY and h.step >= 0]


def buffer_tag_at(path: str, h: shm.Header) -> str:
    """The attempt tag of the save the buffer at ``path`` holds (``h``: its header as
    listed); ``""`` when it names none or the buffer changed or went meanwhile (the load
    checks the tag again when it reads)."""
    from dlrover_plugin_flashckpt.choice import UNTAGGED, buffer_tag

    seg = shm.Segment.attach(path)
    if seg is None:
        return UNTAGGED
    try:
        now = seg.read_header()
        if now.seq != h.seq or now.meta_len != h.meta_len:
            return UNTAGGED
        return buffer_tag(seg.meta_bytes(now))
    finally:
        seg.close()


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


def store(shm_dir: str, job: str, holder: str, info: dict, data: Any, ident: dict,
          fill: Callable[[memoryview], bool] | None = None,
          mapped: dict[str, shm.Segment] | None = None) -> str | None:
    """Write one replica on the holder: ``info`` (``dir``, ``rank``, ``world_size``,
    ``step``, ``meta`` bytes, ``data_len``) and ``data`` (a buffer of ``data_len``
    bytes), or, with ``fill``, what ``fill(dst)`` writes into the buffer's data area
    ``dst`` (``data_len`` bytes; it returns False when what it wrote is torn: the
    buffer is then left EMPTY). Takes the replica buffer of this rank that does not
    hold the newest step, grows it when too small. Returns its name (``None``: torn).

    ``mapped``: path -> the caller's mapping of that buffer, kept between calls (the
    holder's): a buffer is mapped once with its page tables filled (``MAP_POPULATE``)
    and reused while it is the file at its path, so the bytes of later replicas are
    written without a page fault per 4 KiB; entries whose file was replaced or removed
    are unmapped. ``None``: every buffer is mapped for this call and closed after it.

    Raises:
        ShmSpaceError: too little shared memory on the holder.
        ValueError: ``data`` is not ``data_len`` bytes.
        Whatever ``fill`` raises (the buffer is left WRITING: never listed).
    """
    n, meta = int(info["data_len"]), bytes(info["meta"])
    if fill is None:
        view = memoryview(data).cast("B")
        if len(view) != n:
            raise ValueError(f"replica of rank {info['rank']} step {info['step']}: "
                             f"{len(view)} bytes received, {n} expected")

        def fill(dst: memoryview) -> bool:
            dst[:] = view
            return True
    paths = [os.path.join(shm_dir, replica_name(job, info["dir"], info["rank"], k, holder))
             for k in range(REPLICA_SLOTS)]
    if mapped is not None:
        for path in [p for p, seg in mapped.items() if seg.replaced()]:
            mapped.pop(path).close()  # its file is gone or another: free its memory
        segs = [mapped.get(p) or shm.Segment.attach(p, populate=True) for p in paths]
    else:
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
        whole = memoryview(seg.mm)
        try:
            ok = fill(whole[h.data_offset:h.data_offset + n])
        finally:
            whole.release()
        if not ok:
            with seg.locked():
                h = seg.read_header()
                h.state, h.step = shm.EMPTY, -1
                seg.write_header(h)
            return None
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
        for path, s in zip(paths, segs):
            if s is None:
                continue
            if mapped is None:
                s.close()
            elif mapped.get(path) is not s:
                old = mapped.get(path)
                mapped[path] = s
                if old is not None:
                    old.close()
