"""The on-disk format of flash checkpoints and its atomic commit. Imports no torch.

A committed step (``<dir>/step_<step:08d>/``)::

    rank_00000.data     the rank's data area: the tensors' raw bytes
    rank_00000.meta     the rank's meta block: pickled tensor table + skeleton
    ...                 one pair per rank of the role
    manifest.json       {"format": "flashckpt-v1", "step", "world_size", "created",
                         "files": {name: {"bytes", "crc32"}}, "ranks": {rank: {...}}}

Commit protocol (any number of nodes writing into a shared directory):

1. each node's persister writes its ranks' files into ``<dir>/.step_<step>.tmp/``,
   ``fsync``s them, then writes ``rank_<r>.done`` (the files' sizes and crc32,
   computed from the bytes it wrote) atomically;
2. whoever finds all ``world_size`` markers takes ``.commit`` (``O_EXCL``), writes the
   manifest from the markers, removes the markers, ``fsync``s, renames the directory
   to ``step_<step>``, ``fsync``s the parent, moves ``latest`` forward, prunes to
   ``keep`` committed steps and removes older unfinished temp directories.

A crash at any point leaves either the previous committed steps untouched plus a
temp directory (ignored, removed by a later commit), or the new committed step.
Reading verifies sizes and crc32 against the manifest (:func:`verify_step`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import socket
import time
import zlib
from typing import Any, Callable

from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError
from dlrover_core.checkpoint.saver import (
    atomic_write_json,
    atomic_write_text,
    committed_steps,
    fsync_dir,
    prune,
    step_dir_name,
)

log = logging.getLogger(__name__)

FORMAT = "flashckpt-v1"
CHUNK = 8 << 20
_TMP_RE = re.compile(r"^\.step_(\d{8,})\.tmp$")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".{step_dir_name(step)}.tmp")


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, meta file) names of ``rank``."""
    return f"rank_{rank:05d}.data", f"rank_{rank:05d}.meta"


def _marker(rank: int) -> str:
    return f"rank_{rank:05d}.done"


def newest_committed(directory: str) -> int | None:
    steps = committed_steps(directory)
    return steps[-1] if steps else None


def latest_step(directory: str) -> int | None:
    """The step the ``latest`` file names (written right after a commit's rename), or
    ``None``."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def pending_tmp_steps(directory: str) -> list[int]:
    """Steps with an unfinished temp directory, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _TMP_RE.match(n)))


class Throttle:
    """Caps a byte stream at ``bytes_per_s`` (0: no cap) by sleeping."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.t0 = time.monotonic()
        self.done = 0

    def account(self, n: int) -> None:
        if self.rate <= 0:
            return
        self.done += n
        ahead = self.done / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def _write_file(path: str, view: memoryview | bytes, throttle: Throttle,
                progress: Callable[[int], None] | None) -> dict:
    crc = 0
    n = len(view)
    with open(path, "wb", buffering=0) as f:
        for off in range(0, n, CHUNK):
            chunk = view[off:off + CHUNK]
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
            if progress is not None:
                progress(len(chunk))
            throttle.account(len(chunk))
        os.fsync(f.fileno())
    return {"bytes": n, "crc32": crc}


def write_shard(directory: str, step: int, rank: int, world_size: int, meta: bytes,
                data: memoryview, extra: dict | None = None, throttle: Throttle | None = None,
                progress: Callable[[int], None] | None = None) -> dict:
    """Write one rank's files of ``step`` into the temp directory and mark them done.

    Returns the marker: ``{"rank", "step", "world_size", "files": {name: {"bytes",
    "crc32"}}, ...extra}``. ``data`` is read once; its crc32 is computed from the same
    bytes that are written.
    """
    tmp = tmp_dir(directory, step)
    os.makedirs(tmp, exist_ok=True)
    throttle = throttle or Throttle(0)
    data_name, meta_name = rank_files(rank)
    files = {data_name: _write_file(os.path.join(tmp, data_name), data, throttle, progress),
             meta_name: _write_file(os.path.join(tmp, meta_name), meta, throttle, None)}
    fsync_dir(tmp)
    marker = {"rank": rank, "step": step, "world_size": world_size, "files": files,
              **(extra or {})}
    atomic_write_json(os.path.join(tmp, _marker(rank)), marker)
    return marker


def _lock_commit(tmp: str) -> bool:
    path = os.path.join(tmp, ".commit")
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                return False
            if owner.get("host") == me["host"] and not _pid_alive(int(owner.get("pid", 0))):
                try:
                    os.unlink(path)  # the committer died; take over
                except OSError:
                    return False
                continue
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def try_commit(directory: str, step: int, world_size: int, keep: int) -> bool:
    """Commit ``step`` when every rank's files are in its temp directory.

    Returns True when this call committed it (False: ranks missing, another process
    commits, or a newer step is committed already, in which case the temp directory is
    removed).
    """
    tmp = tmp_dir(directory, step)
    newest = newest_committed(directory)
    if newest is not None and step < newest:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    markers = []
    for r in range(world_size):
        try:
            with open(os.path.join(tmp, _marker(r))) as f:
                markers.append(json.load(f))
        except (OSError, ValueError):
            return False
    if not _lock_commit(tmp):
        return False
    files: dict[str, Any] = {}
    ranks: dict[str, Any] = {}
    for m in markers:
        files.update(m["files"])
        ranks[str(m["rank"])] = {k: v for k, v in m.items() if k not in ("files", "rank")}
    manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                "created": time.time(), "files": files, "ranks": ranks}
    atomic_write_json(os.path.join(tmp, MANIFEST), manifest)
    for r in range(world_size):
        os.unlink(os.path.join(tmp, _marker(r)))
    os.unlink(os.path.join(tmp, ".commit"))
    fsync_dir(tmp)
    final = os.path.join(directory, step_dir_name(step))
    old = None
    if os.path.exists(final):  # the same step saved again after a restart from an older one
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(directory)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    _advance_latest(directory, step)
    prune(directory, keep)
    for s in pending_tmp_steps(directory):
        if s < step:
            shutil.rmtree(tmp_dir(directory, s), ignore_errors=True)
    return True


def _advance_latest(directory: str, step: int) -> None:
    path = os.path.join(directory, "latest")
    try:
        with open(path) as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        current = -1
    if step >= current or current not in committed_steps(directory):
        atomic_write_text(path, f"{step}\n")


def read_manifest(step_dir: str) -> dict:
    """The manifest of a committed step.

    Raises:
        CorruptCheckpointError: missing or unreadable, or not a flash checkpoint.
    """
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{step_dir}: unreadable manifest ({exc})") from None
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
        CorruptCheckpointError: missing manifest or file, a size or crc32 mismatch, or a
            manifest for another world size; the message names the file.
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
        path = os.path.join(step_dir, name)
        if meta is None:
            raise CorruptCheckpointError(f"{step_dir}: the manifest does not list {name}")
        if not os.path.exists(path):
            raise CorruptCheckpointError(f"{step_dir}: file {name} is missing")
        size = os.path.getsize(path)
        if size != meta["bytes"]:
            raise CorruptCheckpointError(
                f"{step_dir}: {name} has {size} bytes, the manifest says {meta['bytes']}")
        if file_crc32(path) != meta["crc32"]:
            raise CorruptCheckpointError(f"{step_dir}: {name} crc32 does not match the manifest")
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
