"""Attempts and the current lineage of a flash checkpoint directory. Imports no torch.

An **attempt** is one incarnation of the role: ``{"run_id", "world_size", "epoch"}``
(``epoch``: a token rank 0 draws at every ``load()`` and shares with the other ranks).
``<dir>/lineage.json`` names the current attempt and the step it restored (``base``):
the **current lineage** is the committed steps up to ``base`` plus those the current
attempt committed (:func:`lineage_steps`). A committed step whose files have other
sizes than its manifest gives is quarantined (``step_<n>.corrupt``) on the way.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid

from dlrover_core.checkpoint.manifest import MANIFEST
from dlrover_core.checkpoint.saver import (
    atomic_write_json,
    committed_steps,
    quarantine,
    step_dir_name,
)

LINEAGE = "lineage.json"


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
    """Bytes appended to a meta block (after its body, which ``meta.unpack_meta``
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


_READ = object()


def lineage_steps(directory: str, check_sizes: bool = True,
                  lineage: dict | None | object = _READ) -> list[int]:
    """Committed steps of the current lineage, oldest first: not quarantined,
    accepted by :func:`accepts` (by the attempt in their manifest), and with
    ``check_sizes`` every file of the size its manifest gives; a step whose sizes
    differ (truncated, cut short) is quarantined on the way. ``lineage``: the
    contents of ``lineage.json`` as the caller read it (default: read now)."""
    if lineage is _READ:
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
    return newest_with_lineage(directory)[1]


def newest_with_lineage(directory: str) -> tuple[dict | None, int | None]:
    """``(lineage, newest)``: ``lineage.json`` as read once, and the newest verified
    step of that lineage (:func:`newest_committed`), so that a caller judges saves
    against the same lineage the step was chosen in (a new attempt may write its
    lineage at any moment)."""
    lineage = read_lineage(directory)
    steps = lineage_steps(directory, lineage=lineage)
    return lineage, (steps[-1] if steps else None)


def obsolete(lineage: dict | None, newest: int | None, step: int, attempt: dict,
             saved_at: float) -> bool:
    """Whether a save of ``step`` by ``attempt`` at ``saved_at`` (unix s) will never
    need writing, given ``(lineage, newest)`` of :func:`newest_with_lineage`: its step
    is at or below ``newest`` and it is the lineage's own attempt's, or it was made
    before the lineage started (an earlier attempt's, superseded or abandoned).

    A save of another attempt made since the lineage started is not obsolete: it is a
    newer attempt's whose lineage was not written yet when ``lineage`` was read (rank 0
    writes it at its first save; another rank may save first, and a persister may read
    the lineage just before). Its step, such as 210 after a rollback from 300 to 200,
    is judged again against the new lineage (found by CI: the persister marked the
    rollback's save of 210 persisted against the old lineage's 300, and never wrote
    it)."""
    if newest is None or step > newest:
        return False
    if lineage is None or attempt_tag(attempt) == attempt_tag(lineage.get("attempt") or {}):
        return True
    return saved_at < float(lineage.get("started") or 0.0)


def latest_step(directory: str) -> int | None:
    """The step the ``latest`` file names (written right after a commit's rename) when
    it is a committed step of the current lineage, else ``None``."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            step = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return step if step in lineage_steps(directory, check_sizes=False) else None
