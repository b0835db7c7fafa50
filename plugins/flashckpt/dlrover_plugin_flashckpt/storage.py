"""The on-disk format of flash checkpoints and its atomic commit. Imports no torch.

A committed step (``<dir>/step_<step:08d>/``)::

    rank_00000.data     the rank's data area: the tensors' raw bytes
    rank_00000.meta     the rank's meta block: tensor table + skeleton (tagged JSON)
    ...                 one pair per rank of the role
    manifest.json       {"format": "flashckpt-v1", "step", "world_size", "created",
                         "attempt", "files": {name: {"bytes", "crc32"}},
                         "ranks": {rank: {...}}}

An **attempt** is one incarnation of the role: ``{"run_id", "world_size", "epoch"}``
(``epoch``: a token rank 0 draws at every ``load()`` and shares with the other ranks).
``<dir>/lineage.json`` names the current attempt and the step it restored (``base``):
the **current lineage** is the committed steps up to ``base`` plus those the current
attempt committed.

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

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import socket
import time
import uuid
import zlib
from typing import Any, Callable

from dlrover_core.atomic_io import replace_dir, write_all
from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError, DamagedStepError
from dlrover_core.checkpoint.saver import (
    atomic_write_json,
    atomic_write_text,
    committed_steps,
    fsync_dir,
    prune,
    quarantine,
    step_dir_name,
)

log = logging.getLogger(__name__)

FORMAT = "flashckpt-v1"
CHUNK = 8 << 20
LINEAGE = "lineage.json"
#: a ``.commit`` lock older than this (s) is taken over even from another host: a
#: commit holds it only for a manifest write and a few renames
LOCK_STALE_S = 300.0
_TMP_RE = re.compile(r"^\.step_(\d{8,})\.tmp$")
_MARKER_RE = re.compile(r"^rank_(\d{5})\.([0-9a-f]{16})-(\d+)-([0-9a-f]{8})\.done$")


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".{step_dir_name(step)}.tmp")


def rank_files(rank: int) -> tuple[str, str]:
    """(data file, meta file) names of ``rank`` in a committed step."""
    return f"rank_{rank:05d}.data", f"rank_{rank:05d}.meta"


# ----------------------------------------------------------------------------- attempts
def make_attempt(run_id: str, world_size: int, epoch: str = "") -> dict:
    """``{"run_id", "world_size", "epoch"}`` of one incarnation of a role."""
    return {"run_id": str(run_id or ""), "world_size": int(world_size), "epoch": str(epoch)}


def new_epoch() -> str:
    return uuid.uuid4().hex


def attempt_tag(attempt: dict) -> str:
    """16 hex digits naming ``attempt`` in temp file names."""
    key = json.dumps(make_attempt(attempt.get("run_id", ""), attempt.get("world_size", 0),
                                  attempt.get("epoch", "")), sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


_TRAILER = b"\n#dlrover-attempt-v1 "


def attempt_trailer(attempt: dict) -> bytes:
    """Bytes appended to a meta block (after its body, which ``layout.unpack_meta``
    ignores: it reads the length its header gives) that name the attempt of the save,
    readable without decoding the block (:func:`meta_attempt`)."""
    return _TRAILER + json.dumps(make_attempt(**attempt), sort_keys=True).encode()


def meta_attempt(meta: bytes) -> dict | None:
    """The attempt :func:`attempt_trailer` appended to ``meta``, or ``None``."""
    i = bytes(meta).rfind(_TRAILER)
    if i < 0:
        return None
    try:
        att = json.loads(bytes(meta[i + len(_TRAILER):]))
        return make_attempt(att["run_id"], att["world_size"], att["epoch"])
    except (ValueError, KeyError, TypeError):
        return None


def read_lineage(directory: str) -> dict | None:
    """The current lineage (``{"attempt", "base", "started"}``), or ``None``."""
    try:
        with open(os.path.join(directory, LINEAGE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def accepts(lineage: dict | None, step: int, attempt: dict) -> bool:
    """Whether a save of ``step`` by ``attempt`` belongs to the current ``lineage``:
    it is the lineage's attempt, or ``step`` is not above the step it restored (a
    breakpoint save of the previous attempt that the new one restored from)."""
    if lineage is None:
        return True
    if attempt_tag(attempt) == attempt_tag(lineage.get("attempt") or {}):
        return True
    base = lineage.get("base")
    return base is not None and step <= int(base)


def start_lineage(directory: str, attempt: dict, base: int | None) -> None:
    """Make ``attempt`` the current one, having restored ``base`` (``None``: nothing):
    from now on, committed steps above ``base`` of other attempts (another lineage,
    such as the steps after an explicit ``load(step=...)`` of an older one) no longer
    count (:func:`lineage_steps`), and a temp directory of another attempt above
    ``base`` is never committed."""
    os.makedirs(directory, exist_ok=True)
    atomic_write_json(os.path.join(directory, LINEAGE),
                      {"attempt": make_attempt(**attempt), "base": base,
                       "started": time.time(), "host": socket.gethostname()})


def _manifest_attempt(directory: str, step: int) -> dict | None:
    try:
        with open(os.path.join(directory, step_dir_name(step), MANIFEST)) as f:
            return json.load(f).get("attempt")
    except (OSError, ValueError):
        return None


def sizes_match(step_dir: str) -> bool | None:
    """Whether every file of the step has the size its manifest gives (a ``stat``
    each, no read); ``None`` when the manifest or a file is missing (being pruned)."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return False
    for name, meta in manifest.get("files", {}).items():
        try:
            if os.path.getsize(os.path.join(step_dir, name)) != meta["bytes"]:
                return False
        except FileNotFoundError:
            return None
    return True


def lineage_steps(directory: str, check_sizes: bool = True) -> list[int]:
    """Committed steps of the current lineage, oldest first: not quarantined,
    accepted by :func:`accepts` (by the attempt in their manifest), and with
    ``check_sizes`` every file of the size its manifest gives; a step whose sizes
    differ (truncated, cut short) is quarantined on the way."""
    lineage = read_lineage(directory)
    out = []
    for s in committed_steps(directory):
        if lineage is not None:
            att = _manifest_attempt(directory, s)
            if not accepts(lineage, s, att or {}):
                continue
        if check_sizes:
            ok = sizes_match(os.path.join(directory, step_dir_name(s)))
            if ok is None:
                continue
            if not ok:
                quarantine(directory, s, "a file's size differs from the manifest")
                continue
        out.append(s)
    return out


def newest_committed(directory: str) -> int | None:
    """The newest verified step of the current lineage (:func:`lineage_steps`), or
    ``None``."""
    steps = lineage_steps(directory)
    return steps[-1] if steps else None


def latest_step(directory: str) -> int | None:
    """The step the ``latest`` file names (written right after a commit's rename) when
    it is a committed step of the current lineage, else ``None``."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            step = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return step if step in lineage_steps(directory, check_sizes=False) else None


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
            dead = owner.get("host") == me["host"] and not _pid_alive(int(owner.get("pid", 0)))
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


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
        path = os.path.join(step_dir, name)
        if meta is None:
            raise CorruptCheckpointError(f"{step_dir}: the manifest does not list {name}")
        if not os.path.exists(path):
            raise CorruptCheckpointError(f"{step_dir}: file {name} is missing")
        size = os.path.getsize(path)
        if size != meta["bytes"]:
            raise DamagedStepError(
                f"{step_dir}: {name} has {size} bytes, the manifest says {meta['bytes']}")
        if file_crc32(path) != meta["crc32"]:
            raise DamagedStepError(f"{step_dir}: {name} crc32 does not match the manifest")
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
