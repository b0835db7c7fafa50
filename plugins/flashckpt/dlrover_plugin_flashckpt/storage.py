"""Writing flash checkpoints to disk and their atomic commit. Imports no torch.

A committed step (``<dir>/step_<step:08d>/``)::

    rank_00000.data     the rank's data area: the tensors' raw bytes
    rank_00000.meta     the rank's meta block: tensor table + skeleton (tagged JSON)
    ...                 one pair per rank of the role
    manifest.json       {"format": "flashckpt-v1", "step", "world_size", "created",
                         "attempt", "files": {name: {"bytes", "crc32"}},
                         "ranks": {rank: {...}}}

Attempts (incarnations of the role) and the current lineage are :mod:`.lineage`'s;
the committed step's files, manifest and verification :mod:`.committed`'s.

Commit protocol (any number of nodes writing into a shared directory):

1. each node's persister writes its ranks' files into ``<dir>/.step_<step>.tmp/``
   under names of their own (``rank_<r>.<attempt tag>-<seq>-<nonce>.data``/``.meta``:
   a file is never rewritten in place), ``fsync``s them, then writes the marker
   ``rank_<r>.<same>.done`` (attempt, the slot's sequence number, the files' sizes and
   crc32 computed from the bytes it wrote) atomically. A write that fails removes
   what it wrote of its files (a full disk keeps no partial file);
2. whoever finds a marker of every rank of one attempt that the lineage accepts
   (:func:`accepts`: the current attempt, or a step not above ``base``), or the
   intent of an interrupted commit, takes the step's commit lock
   ``<dir>/.step_<step>.commit`` (:mod:`.commitlock`: a lease naming host, pid and
   process start time; the takeover rule never compares clocks across hosts). The
   lock sits beside the temp directory, so it is held until the commit's end, and
   it is released on every path;
3. under the lock, the committer writes the **intent** ``commit.json`` into the temp
   directory (the manifest, and which temp file becomes which plain name) before it
   consumes any marker; then renames the files to their plain names, removes every
   other file (markers, other attempts' shards, torn writes), checks every file's size
   against the manifest, writes ``manifest.json``, ``fsync``s, checks it still holds
   the lock, and moves the directory to ``step_<step>`` (an existing one is swapped
   atomically, :func:`dlrover_core.atomic_io.replace_dir`); then removes the intent
   from the committed step, moves ``latest`` forward, prunes to ``keep`` steps of the
   lineage and removes older unfinished temp directories and locks, and the old copy
   a swap without an atomic exchange moved aside (:func:`.commit.settle`).

A persister claims a rank's save for writing only while its step is not committed,
reading the newest committed step after the temp directory's markers (a commit by
another node consumes them), so no write of a step begins after its commit. The temp
directory of the newest committed step that still holds nothing to commit (the old
copy a swap left when its committer died before removing it, a late write's files) is
removed by the next commit try of that step (:func:`.commit.try_commit`).

Every step of 3 can be done again: a committer that finds an intent the lineage accepts
finishes that commit (a rename already done is skipped), whatever stopped the previous
one (a kill, ``ENOSPC``, ``EIO``, a lost lock); an intent of another lineage is dropped.
A crash after the move leaves the step committed; :func:`.commit.finish_tail` (run by
the persister) moves ``latest`` and prunes when a crash stopped that. A persister counts
a save as persisted only once its step (or a newer one of the lineage) is committed,
and tries the commit again until then (:mod:`.persisting`).

A crash at any point leaves either the previous committed steps untouched plus a
temp directory (finished or removed by a later commit), or the new committed step.
Reading verifies sizes and crc32 against the manifest (:func:`verify_step`); a step
that fails is quarantined (``step_<n>.corrupt``) and no longer counts as committed.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from dlrover_core.atomic_io import write_all
from dlrover_core.checkpoint.saver import fsync_dir
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import durable

# re-exported: the commit's users reach it through ``storage``
from dlrover_plugin_flashckpt.commit import (  # noqa: F401
    INTENT,
    CommitLockLost,
    committable,
    finish_tail,
    pending_tmp_steps,
    read_intent,
    read_markers,
    settle,
    tail_pending,
    tmp_dir,
    try_commit,
    written_saves,
)
from dlrover_plugin_flashckpt.commitlock import LOCK_STALE_S, lock_path  # noqa: F401

# re-exported: the commit's users reach the step format and the lineage through ``storage``
from dlrover_plugin_flashckpt.committed import (  # noqa: F401
    CHUNK,
    FORMAT,
    file_crc32,
    open_rank,
    rank_files,
    read_manifest,
    verify_step,
)
from dlrover_plugin_flashckpt.lineage import (  # noqa: F401
    LINEAGE,
    accepts,
    attempt_tag,
    attempt_trailer,
    latest_step,
    lineage_steps,
    make_attempt,
    meta_attempt,
    new_epoch,
    newest_committed,
    newest_with_lineage,
    obsolete,
    read_lineage,
    sizes_match,
    start_lineage,
)

log = logging.getLogger(__name__)

for _what, _doc in (("data", "a rank's data file is written (all bytes, before its fsync)"),
                    ("data_fsync", "a rank's data file is fsynced"),
                    ("meta", "a rank's meta file is written (before its fsync)"),
                    ("meta_fsync", "a rank's meta file is fsynced"),
                    ("dir_fsync", "the temp directory is fsynced after a rank's files"),
                    ("marker", "a rank's marker is written (before its fsync)")):
    declare(f"flash.persist.{_what}", "io", "persist", _doc)


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


def _open_for_write(path: str) -> Any:
    """A new file (``O_EXCL``: an existing one is never rewritten), unbuffered."""
    return open(path, "xb", buffering=0)


def _write_file(path: str, view: memoryview | bytes, throttle: Throttle,
                progress: Callable[[int], None] | None, point: str) -> dict:
    """Write ``view`` to the new file ``path`` in ``CHUNK``-byte pieces and ``fsync`` it;
    returns ``{"bytes", "crc32"}``. A file of more than one piece has the crc32 of each
    piece computed in a helper thread while that piece is written (``zlib.crc32`` and
    ``write`` both release the GIL), so that the crc32, a pass over the bytes on one
    core, does not add its time to the write's."""
    crc = 0
    n = len(view)
    with _open_for_write(path) as f, ThreadPoolExecutor(
            1, thread_name_prefix="flash-crc32") as pool:
        for off in range(0, n, CHUNK):
            chunk = view[off:off + CHUNK]
            if n > CHUNK:
                # chained: the crc32 of the pieces before is done (it ran during the
                # previous write); this piece's runs while it is written
                pending = pool.submit(zlib.crc32, chunk, crc)
            else:
                crc = zlib.crc32(chunk, crc)
            try:
                write_all(f, chunk)  # FileIO.write may write less than asked
            finally:
                if n > CHUNK:
                    crc = pending.result()
            if progress is not None:
                progress(len(chunk))
            throttle.account(len(chunk))
        crashpoint(f"flash.persist.{point}", path=path)
        crashpoint(f"flash.persist.{point}_fsync", path=path)
        os.fsync(f.fileno())
    size = os.path.getsize(path)
    if size != n:
        raise OSError(f"{path}: {size} bytes on disk after writing {n}")
    return {"bytes": n, "crc32": crc}


def write_shard(directory: str, step: int, rank: int, world_size: int, meta: bytes,
                data: memoryview, extra: dict | None = None, throttle: Throttle | None = None,
                progress: Callable[[int], None] | None = None,
                attempt: dict | None = None) -> dict:
    """Write one rank's files of ``step`` into the temp directory and mark them done.

    ``attempt`` (:func:`make_attempt`; default: run id ``""``, this world size, epoch
    ``""``) names the files, with ``extra["seq"]`` (the slot's sequence number) and a
    random nonce, so that no file is ever rewritten in place. When a write fails, the
    files this call made are removed before the error is raised.

    Returns the marker: ``{"rank", "step", "world_size", "attempt", "seq", "files":
    {plain name: {"bytes", "crc32", "tmp": temp name}}, ...extra}``. ``data`` is read
    once; its crc32 is computed from the same bytes that are written.
    Raises:
        ValueError: ``attempt`` is for another world size.
        OSError: a write failed (a full disk: ``ENOSPC``; a failing one: ``EIO``) or
            left a file of another size.
    """
    attempt = make_attempt(**(attempt or {"run_id": "", "world_size": world_size}))
    if attempt["world_size"] != world_size:
        raise ValueError(f"write_shard: attempt world_size {attempt['world_size']} but "
                         f"world_size {world_size}")
    tmp = tmp_dir(directory, step)
    os.makedirs(tmp, exist_ok=True)
    throttle = throttle or Throttle(0)
    seq = int((extra or {}).get("seq", 0))
    stem = f"rank_{rank:05d}.{attempt_tag(attempt)}-{seq}-{os.urandom(4).hex()}"
    data_name, meta_name = rank_files(rank)
    files = {}
    made = []
    try:
        for plain, suffix, blob, prog in ((data_name, "data", data, progress),
                                          (meta_name, "meta", meta, None)):
            name = f"{stem}.{suffix}"
            made.append(os.path.join(tmp, name))
            files[plain] = {**_write_file(made[-1], blob, throttle, prog, suffix),
                            "tmp": name}
        crashpoint("flash.persist.dir_fsync", path=tmp)
        fsync_dir(tmp)
        marker = {**(extra or {}), "rank": rank, "step": step, "world_size": world_size,
                  "attempt": attempt, "seq": seq, "files": files}
        durable.write_json(os.path.join(tmp, f"{stem}.done"), marker, "flash.persist.marker")
    except BaseException:
        for path in made:
            durable.remove(path)
        raise
    return marker
