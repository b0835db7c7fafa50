"""The replica buffers of a checkpoint folder in a node's shared memory, by name and
header: list them (:func:`folder_buffers`, :func:`held`), name the attempt of the save
one holds (:func:`buffer_tag_at`), and read one (:func:`open_step`, :func:`read`).
Imports no torch. The copies themselves are :mod:`.replica`'s.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Callable, Iterator

from dlrover_plugin_flashckpt import shm

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


