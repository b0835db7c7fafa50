"""A committed flash checkpoint step on disk: its file names, its manifest, the check
of its files against the manifest and the reading of one rank. Imports no torch.

Layout of ``<dir>/step_<step:08d>/``: ``rank_<r:05d>.data`` (the rank's data area),
``rank_<r:05d>.meta`` (its meta block) per rank, and ``manifest.json`` (``format``,
``step``, ``world_size``, ``attempt``, ``files: {name: {"bytes", "crc32"}}``); written
by :func:`.storage.try_commit`.
"""

from __future__ import annotations

import mmap
import os
import zlib

from dlrover_core.checkpoint.manifest import (CorruptCheckpointError, check_file,
                                              read_manifest_file)

FORMAT = "flashckpt-v1"
#: bytes per read when a file's crc32 is computed
CHUNK = 8 << 20


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, meta file) names of ``rank`` in a committed step."""
    return f"rank_{rank:05d}.data", f"rank_{rank:05d}.meta"


def read_manifest(step_dir: str) -> dict:
    """The manifest of a committed step.

    Raises:
        CorruptCheckpointError: missing or unreadable, or not a flash checkpoint.
    """
    manifest = read_manifest_file(step_dir)
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{step_dir}: format {manifest.get('format')!r} is not "
                                     f"{FORMAT!r} (written by another saver?)")
    return manifest


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return crc
            crc = zlib.crc32(b, crc)


def verify_step(step_dir: str, ranks: list[int] | None = None,
                world_size: int | None = None) -> dict:
    """Check the files of ``ranks`` (default: all) against the manifest; return it.

    Raises:
        DamagedStepError: a size or crc32 mismatch (the message names the file).
        CorruptCheckpointError: missing manifest or file, or a manifest for another
            world size.
    """
    manifest = read_manifest(step_dir)
    if world_size is not None and manifest.get("world_size") != world_size:
        raise CorruptCheckpointError(
            f"{step_dir}: saved by world_size {manifest.get('world_size')}, this role has "
            f"{world_size}; a flash checkpoint restores into the same world size")
    names = [n for r in (ranks if ranks is not None else range(manifest["world_size"]))
             for n in rank_files(r)]
    for name in names:
        meta = manifest["files"].get(name)
        if meta is None:
            raise CorruptCheckpointError(f"{step_dir}: the manifest does not list {name}")
        check_file(step_dir, name, meta, "crc32", file_crc32)
    return manifest


def open_rank(step_dir: str, rank: int) -> tuple[bytes, mmap.mmap | bytes]:
    """(meta bytes, data mapping) of one rank of a committed step (read-only)."""
    data_name, meta_name = rank_files(rank)
    with open(os.path.join(step_dir, meta_name), "rb") as f:
        meta = f.read()
    with open(os.path.join(step_dir, data_name), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data: mmap.mmap | bytes = (mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                                   if size else b"")
    return meta, data
