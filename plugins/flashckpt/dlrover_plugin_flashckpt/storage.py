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
   crc32 computed from the bytes it wrote) atomically;
2. whoever finds a marker of every rank of one attempt that the lineage accepts
   (:func:`accepts`: the current attempt, or a step not above ``base``) takes
   ``.commit`` (``O_EXCL``; :func:`_lock_commit` for the takeover rule), writes the
   manifest from those markers, renames their files to the plain names, removes
   every other file (other attempts' shards, markers), checks every file's size
   against the manifest, ``fsync``s, moves the directory to ``step_<step>`` (an
   existing one is swapped atomically, :func:`dlrover_core.atomic_io.replace_dir`),
   moves ``latest`` forward, prunes to ``keep`` steps of the lineage and removes
   older unfinished temp directories.

A crash at any point leaves either the previous committed steps untouched plus a
temp directory (ignored, removed by a later commit), or the new committed step.
Reading verifies sizes and crc32 against the manifest (:func:`verify_step`); a step
that fails is quarantined (``step_<n>.corrupt``) and no longer counts as committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import zlib
from typing import Any, Callable

from dlrover_core.atomic_io import replace_dir, write_all
from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError
from dlrover_core.checkpoint.saver import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    prune,
    step_dir_name,
)
from dlrover_core.pids import pid_alive

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
    read_lineage,
    sizes_match,
    start_lineage,
)

log = logging.getLogger(__name__)

#: a ``.commit`` lock older than this (s) is taken over even from another host: a
#: commit holds it only for a manifest write and a few renames
LOCK_STALE_S = 300.0
_TMP_RE = re.compile(r"^\.step_(\d{8,})\.tmp$")
_MARKER_RE = re.compile(r"^rank_(\d{5})\.([0-9a-f]{16})-(\d+)-([0-9a-f]{8})\.done$")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".{step_dir_name(step)}.tmp")


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


def _open_for_write(path: str) -> Any:
    """A new file (``O_EXCL``: an existing one is never rewritten), unbuffered."""
    return open(path, "xb", buffering=0)


def _write_file(path: str, view: memoryview | bytes, throttle: Throttle,
                progress: Callable[[int], None] | None) -> dict:
    crc = 0
    n = len(view)
    with _open_for_write(path) as f:
        for off in range(0, n, CHUNK):
            chunk = view[off:off + CHUNK]
            crc = zlib.crc32(chunk, crc)
            write_all(f, chunk)  # FileIO.write may write less than asked
            if progress is not None:
                progress(len(chunk))
            throttle.account(len(chunk))
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
    random nonce, so that no file is ever rewritten in place.

    Returns the marker: ``{"rank", "step", "world_size", "attempt", "seq", "files":
    {plain name: {"bytes", "crc32", "tmp": temp name}}, ...extra}``. ``data`` is read
    once; its crc32 is computed from the same bytes that are written.
    Raises:
        ValueError: ``attempt`` is for another world size.
        OSError: a write failed (a full disk: ``ENOSPC``) or left a file of another
            size.
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
    for plain, suffix, blob, prog in ((data_name, "data", data, progress),
                                      (meta_name, "meta", meta, None)):
        name = f"{stem}.{suffix}"
        files[plain] = {**_write_file(os.path.join(tmp, name), blob, throttle, prog),
                        "tmp": name}
    fsync_dir(tmp)
    marker = {**(extra or {}), "rank": rank, "step": step, "world_size": world_size,
              "attempt": attempt, "seq": seq, "files": files}
    atomic_write_json(os.path.join(tmp, f"{stem}.done"), marker)
    return marker


def _lock_commit(tmp: str) -> bool:
    """Take ``<tmp>/.commit`` (``O_EXCL``). It holds ``{"host", "pid", "time",
    "nonce"}``. A lock is taken over when its holder is gone: on this host, its pid
    is not alive; on any host, it is older than :data:`LOCK_STALE_S` (or unreadable
    and that old). A takeover renames the stale lock to a name of its own first and
    checks that it moved the lock it judged (two takers cannot both win)."""
    path = os.path.join(tmp, ".commit")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
          "nonce": os.urandom(8).hex()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
                age = time.time() - float(owner.get("time", 0))
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                owner = {}
                try:
                    age = time.time() - os.path.getmtime(path)
                except OSError:
                    continue
            dead = owner.get("host") == me["host"] and not pid_alive(int(owner.get("pid", 0)))
            if not dead and age <= LOCK_STALE_S:
                return False
            grab = f"{path}.stale-{me['nonce']}"
            try:
                os.rename(path, grab)
            except OSError:
                return False
            try:
                with open(grab) as f:
                    moved = json.load(f)
            except (OSError, ValueError):
                moved = {}
            if owner and moved != owner:  # another taker's fresh lock: give it back
                try:
                    os.link(grab, path)
                except OSError:
                    pass
                os.unlink(grab)
                return False
            os.unlink(grab)
            log.warning("took over the commit lock of %s (held by %s, %.0f s old)", tmp,
                        owner or "an unreadable lock", age)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return True
    return False


def read_markers(tmp: str) -> list[dict]:
    """Every parsable marker in the temp directory ``tmp`` (with ``"_name"``)."""
    out = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return out
    for n in names:
        if not _MARKER_RE.match(n):
            continue
        try:
            with open(os.path.join(tmp, n)) as f:
                m = json.load(f)
        except (OSError, ValueError):
            continue
        m["_name"] = n
        out.append(m)
    return out


def _complete_set(markers: list[dict], step: int, world_size: int, lineage: dict | None,
                  attempt: dict | None) -> list[dict] | None:
    """One marker per rank ``0..world_size-1``, all of one attempt of ``world_size``
    (the newest ``seq`` per rank), that the lineage accepts; ``None`` when no attempt
    has them all."""
    groups: dict[str, dict[int, dict]] = {}
    for m in markers:
        att = m.get("attempt") or {}
        if m.get("step") != step or m.get("world_size") != world_size \
                or att.get("world_size") != world_size:
            continue
        if attempt is not None and attempt_tag(att) != attempt_tag(attempt):
            continue
        if not accepts(lineage, step, att):
            continue
        ranks = groups.setdefault(attempt_tag(att), {})
        r = int(m.get("rank", -1))
        if r not in ranks or ranks[r].get("seq", 0) < m.get("seq", 0):
            ranks[r] = m
    for ranks in groups.values():
        if set(ranks) == set(range(world_size)):
            return [ranks[r] for r in range(world_size)]
    return None


def try_commit(directory: str, step: int, world_size: int, keep: int,
               attempt: dict | None = None) -> bool:
    """Commit ``step`` when one attempt has every rank's files in its temp directory.

    ``attempt``: commit only that attempt's files (default: any single attempt the
    lineage accepts). Returns True when this call committed it (False: ranks missing,
    another process commits, or a newer verified step of the lineage is committed
    already, in which case the temp directory is removed).
    Raises:
        CorruptCheckpointError: a file's size differs from its marker (a short write
            that went unnoticed); nothing is committed.
    """
    tmp = tmp_dir(directory, step)
    newest = newest_committed(directory)
    if newest is not None and step < newest:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    lineage = read_lineage(directory)
    chosen = _complete_set(read_markers(tmp), step, world_size, lineage, attempt)
    if chosen is None or not _lock_commit(tmp):
        return False
    try:
        # the markers may have been consumed by a committer that finished meanwhile
        chosen = _complete_set(read_markers(tmp), step, world_size,
                               read_lineage(directory), attempt)
        if chosen is None:
            return False
        files: dict[str, Any] = {}
        ranks: dict[str, Any] = {}
        for m in chosen:
            for plain, f in m["files"].items():
                tmp_path = os.path.join(tmp, f["tmp"])
                size = os.path.getsize(tmp_path)
                if size != f["bytes"]:
                    raise CorruptCheckpointError(
                        f"{tmp}: {f['tmp']} has {size} bytes, its marker says {f['bytes']}")
                files[plain] = {"bytes": f["bytes"], "crc32": f["crc32"]}
            ranks[str(m["rank"])] = {k: v for k, v in m.items()
                                     if k not in ("files", "rank", "_name", "attempt")}
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "attempt": chosen[0]["attempt"], "created": time.time(),
                    "files": files, "ranks": ranks}
        for m in chosen:
            for plain, f in m["files"].items():
                os.replace(os.path.join(tmp, f["tmp"]), os.path.join(tmp, plain))
            os.unlink(os.path.join(tmp, m["_name"]))
        keep_names = set(files) | {".commit"}
        for n in os.listdir(tmp):  # other attempts' shards and markers, torn writes
            if n not in keep_names:
                p = os.path.join(tmp, n)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        atomic_write_json(os.path.join(tmp, MANIFEST), manifest)
        for plain, f in files.items():  # sizes on disk, against the manifest
            size = os.path.getsize(os.path.join(tmp, plain))
            if size != f["bytes"]:
                raise CorruptCheckpointError(f"{tmp}: {plain} has {size} bytes, the manifest "
                                             f"says {f['bytes']}")
    except BaseException:
        try:
            os.unlink(os.path.join(tmp, ".commit"))
        except OSError:
            pass
        raise
    os.unlink(os.path.join(tmp, ".commit"))
    fsync_dir(tmp)
    final = os.path.join(directory, step_dir_name(step))
    old = replace_dir(tmp, final)  # the same step saved again: swapped in one step
    if old:
        shutil.rmtree(old, ignore_errors=True)
    _advance_latest(directory, step)
    prune(directory, keep, steps=lineage_steps(directory, check_sizes=False), protect=step)
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
    if step >= current or current not in lineage_steps(directory, check_sizes=False):
        atomic_write_text(path, f"{step}\n")


