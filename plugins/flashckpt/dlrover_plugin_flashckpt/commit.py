"""The atomic commit of a flash checkpoint step, and its completion after a crash.
The protocol is described in :mod:`.storage`'s docstring ("Commit protocol"). Imports
no torch."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any

from dlrover_core.atomic_io import aside_name, fsync_dir, replace_dir
from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError
from dlrover_core.checkpoint.saver import prune, step_dir_name
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import commitlock, durable
from dlrover_plugin_flashckpt.committed import FORMAT
from dlrover_plugin_flashckpt.lineage import (
    accepts,
    attempt_tag,
    latest_step,
    lineage_steps,
    newest_committed,
    read_lineage,
)

log = logging.getLogger(__name__)

#: the commit's intent in the temp directory: the manifest, and which temp file becomes
#: which plain name; written before any marker is consumed
INTENT = "commit.json"
_TMP_RE = re.compile(r"^\.step_(\d{8,})\.tmp$")
#: a commit lock, or what a killed taker left of one (its new lease, a moved stale one)
_LOCK_RE = re.compile(r"^\.step_(\d{8,})\.commit(\.(new|stale)-[0-9a-f]+)?$")
_MARKER_RE = re.compile(r"^rank_(\d{5})\.([0-9a-f]{16})-(\d+)-([0-9a-f]{8})\.done$")

for _name, _kind, _doc in (
        ("intent_write", "io", "the commit's intent (manifest + temp names) is written"),
        ("shard_rename", "io", "a shard file is renamed to its plain name"),
        ("cleanup", "io", "the other files of the temp directory are removed"),
        ("manifest_write", "io", "the manifest is written into the temp directory"),
        ("dir_swap", "io", "the temp directory is moved to (swapped with) step_<n>"),
        ("intent_remove", "io", "the intent is removed from the committed step"),
        ("latest", "io", "'latest' is moved forward"),
        ("prune", "io", "older steps of the lineage are pruned to keep"),
        ("tmp_cleanup", "io", "older unfinished temp directories are removed")):
    declare(f"flash.commit.{_name}", _kind, "commit", _doc)


class CommitLockLost(OSError):
    """The commit lock was removed or taken over while this process committed; the
    step is left for the next try (which finishes it from the intent)."""


def tmp_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f".{step_dir_name(step)}.tmp")


def pending_tmp_steps(directory: str) -> list[int]:
    """Steps with an unfinished temp directory, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _TMP_RE.match(n)))


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


def read_intent(tmp: str) -> dict | None:
    try:
        with open(os.path.join(tmp, INTENT)) as f:
            intent = json.load(f)
        return intent if isinstance(intent, dict) and "manifest" in intent else None
    except (OSError, ValueError):
        return None


def written_saves(directory: str, step: int) -> set[tuple[int, int, float]]:
    """``(rank, seq, saved_at)`` of every save whose files of ``step`` are written in
    its temp directory (a marker, or the intent of a commit under way)."""
    tmp = tmp_dir(directory, step)
    out = {(int(m.get("rank", -1)), int(m.get("seq", 0)), float(m.get("saved_at", 0)))
           for m in read_markers(tmp)}
    intent = read_intent(tmp)
    if intent is not None:
        for r, info in intent["manifest"].get("ranks", {}).items():
            out.add((int(r), int(info.get("seq", 0)), float(info.get("saved_at", 0))))
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


def _intent_ok(intent: dict, step: int, world_size: int, lineage: dict | None) -> bool:
    m = intent["manifest"]
    return m.get("step") == step and m.get("world_size") == world_size \
        and accepts(lineage, step, m.get("attempt") or {})


def _make_intent(tmp: str, step: int, world_size: int, chosen: list[dict]) -> dict:
    files: dict[str, Any] = {}
    names: dict[str, str] = {}
    ranks: dict[str, Any] = {}
    for m in chosen:
        for plain, f in m["files"].items():
            p = os.path.join(tmp, f["tmp"])
            size = os.path.getsize(p) if os.path.exists(p) else None
            if size != f["bytes"]:  # the marker is dropped: the rank is written again
                durable.remove(os.path.join(tmp, m["_name"]))
                raise CorruptCheckpointError(
                    f"{tmp}: {f['tmp']} has {size} bytes, its marker says {f['bytes']}; "
                    f"rank {m['rank']}'s files of step {step} are written again")
            files[plain] = {"bytes": f["bytes"], "crc32": f["crc32"]}
            names[plain] = f["tmp"]
        ranks[str(m["rank"])] = {k: v for k, v in m.items()
                                 if k not in ("files", "rank", "_name", "attempt")}
    manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                "attempt": chosen[0]["attempt"], "created": time.time(),
                "files": files, "ranks": ranks}
    return {"manifest": manifest, "tmp": names}


def _has_work(tmp: str, step: int, world_size: int, lineage: dict | None,
              attempt: dict | None, markers: bool = True) -> bool:
    intent = read_intent(tmp)
    if intent is not None and _intent_ok(intent, step, world_size, lineage):
        return True
    return markers and _complete_set(read_markers(tmp), step, world_size, lineage,
                                     attempt) is not None


def committable(directory: str, step: int, world_size: int) -> bool:
    """Whether the temp directory of ``step`` holds what a commit needs (every rank's
    files of one accepted attempt, or an accepted intent)."""
    return _has_work(tmp_dir(directory, step), step, world_size, read_lineage(directory),
                     None)


def try_commit(directory: str, step: int, world_size: int, keep: int,
               attempt: dict | None = None, markers: bool = True) -> bool:
    """Commit ``step`` when its temp directory holds the intent of an interrupted commit
    that the lineage accepts (finished), or every rank's files of one attempt.

    ``attempt``: commit only that attempt's files (default: any single attempt the
    lineage accepts; an interrupted commit is finished whichever its attempt).
    ``markers=False``: only finish an interrupted commit (its intent). Returns
    True when this call committed it (False: ranks missing, another process holds the
    commit lock, or a newer verified step of the lineage is committed already, in which
    case the temp directory is removed; so is that of the newest committed step itself
    when it holds nothing any attempt could commit). The commit lock is released on
    every path.

    Raises:
        CorruptCheckpointError: a file's size differs from its marker or the intent (a
            short write that went unnoticed); nothing is committed.
        CommitLockLost: the lock was removed or taken over before the directory move.
        OSError: a write, rename or ``fsync`` failed (``ENOSPC``, ``EIO``); the next
            call finishes the commit from where it stopped.
    """
    tmp = tmp_dir(directory, step)
    newest = newest_committed(directory)
    if newest is not None and step < newest:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    lineage = read_lineage(directory)
    if not _has_work(tmp, step, world_size, lineage, attempt, markers):
        if step == newest and not _has_work(tmp, step, world_size, lineage, None):
            # the step is committed and its temp directory holds nothing any attempt
            # could commit: the old copy a re-commit swapped out (its committer died
            # before removing it) or a late writer's files. Nothing else removes it
            # while the step is the newest (found by the chaos run: a temp directory of
            # the final step was left after the job's end)
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    with commitlock.held(directory, step) as lock:
        if lock is None:
            return False
        return _commit_locked(directory, step, world_size, keep, attempt, markers, *lock)


def _commit_locked(directory: str, step: int, world_size: int, keep: int,
                   attempt: dict | None, markers: bool, path: str, lease: dict) -> bool:
    tmp = tmp_dir(directory, step)
    lineage = read_lineage(directory)
    intent = read_intent(tmp)
    if intent is not None and not _intent_ok(intent, step, world_size, lineage):
        durable.remove(os.path.join(tmp, INTENT))  # another lineage's: never finished
        intent = None
    if intent is None:
        # the markers may have been consumed by a committer that finished meanwhile
        chosen = _complete_set(read_markers(tmp), step, world_size, lineage, attempt) \
            if markers else None
        if chosen is None:
            return False
        intent = _make_intent(tmp, step, world_size, chosen)
        durable.write_json(os.path.join(tmp, INTENT), intent, "flash.commit.intent_write")
    else:
        log.warning("finishing the interrupted commit of step %d in %s", step, tmp)
    manifest = intent["manifest"]
    for plain, name in intent["tmp"].items():
        src = os.path.join(tmp, name)
        if os.path.exists(src):
            crashpoint("flash.commit.shard_rename", path=src)
            os.replace(src, os.path.join(tmp, plain))
    crashpoint("flash.commit.cleanup", path=tmp)
    keep_names = set(manifest["files"]) | {INTENT}
    for n in os.listdir(tmp):  # markers, other attempts' shards, torn writes
        if n not in keep_names:
            durable.remove(os.path.join(tmp, n))
    for plain, f in manifest["files"].items():  # sizes on disk, against the manifest
        p = os.path.join(tmp, plain)
        size = os.path.getsize(p) if os.path.exists(p) else None
        if size != f["bytes"]:
            durable.remove(os.path.join(tmp, INTENT))  # never finished: written again
            raise CorruptCheckpointError(
                f"{tmp}: {plain} has {size} bytes, the manifest says {f['bytes']}; the "
                f"commit of step {step} is abandoned and the step is written again")
    durable.write_json(os.path.join(tmp, MANIFEST), manifest, "flash.commit.manifest_write")
    fsync_dir(tmp)
    final = os.path.join(directory, step_dir_name(step))
    durable.remove(os.path.join(final, INTENT))  # an earlier commit's, left by a crash
    if not commitlock.holds(path, lease):
        raise CommitLockLost(f"the commit lock {path} of step {step} was removed or taken "
                             "over while committing; the next try finishes the commit")
    crashpoint("flash.commit.dir_swap", path=final)
    old = replace_dir(tmp, final)  # the same step saved again: swapped in one step
    crashpoint("flash.commit.intent_remove", path=final)
    durable.remove(os.path.join(final, INTENT))
    fsync_dir(final)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    settle(directory, step, keep)
    return True


def settle(directory: str, step: int, keep: int) -> None:
    """The tail of the commit of ``step`` (run again after a crash): ``latest`` moved
    forward, the lineage pruned to ``keep`` steps, older unfinished temp directories
    and their locks removed, and the old copy of ``step`` that a re-commit moved aside
    (where the filesystem has no atomic exchange). Call holding ``step``'s commit
    lock."""
    _advance_latest(directory, step)
    crashpoint("flash.commit.prune", path=directory)
    prune(directory, keep, steps=lineage_steps(directory, check_sizes=False), protect=step)
    crashpoint("flash.commit.tmp_cleanup", path=directory)
    durable.remove_dead_parts(directory, "latest")
    final = os.path.join(directory, step_dir_name(step))
    if os.path.isdir(final):  # a re-commit's old copy, moved aside, left by a crash
        shutil.rmtree(aside_name(final), ignore_errors=True)
    for n in os.listdir(directory):
        m = _TMP_RE.match(n) or _LOCK_RE.match(n)
        if m and int(m.group(1)) < step:
            durable.remove(os.path.join(directory, n))


def tail_pending(directory: str, newest: int | None) -> bool:
    """Whether the commit of the newest committed step ``newest`` was stopped after its
    directory move (``latest`` names an older step, the step still holds the intent,
    or its commit lock is still there)."""
    if newest is None:
        return False
    final = os.path.join(directory, step_dir_name(newest))
    return latest_step(directory) != newest or os.path.exists(os.path.join(final, INTENT)) \
        or os.path.exists(commitlock.lock_path(directory, newest))


def finish_tail(directory: str, keep: int) -> bool:
    """Run :func:`settle` for the newest committed step when :func:`tail_pending`
    (taking over the lock of a committer that died). Returns whether it did."""
    newest = newest_committed(directory)
    if not tail_pending(directory, newest):
        return False
    with commitlock.held(directory, newest) as lock:
        if lock is None:
            return False
        durable.remove(os.path.join(directory, step_dir_name(newest), INTENT))
        settle(directory, newest, keep)
    return True


def _advance_latest(directory: str, step: int) -> None:
    path = os.path.join(directory, "latest")
    try:
        with open(path) as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        current = -1
    if step >= current or current not in lineage_steps(directory, check_sizes=False):
        durable.write_bytes(path, f"{step}\n".encode(), "flash.commit.latest")
