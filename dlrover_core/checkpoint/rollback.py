"""A rollback of the ``disk`` saver's history: after ``load(step=N)`` restored a step older
than the newest committed one, the first save sets ``N`` aside as the new base: every
committed step above ``N`` belongs to the abandoned history and is renamed
``step_<n>.abandoned`` (kept for inspection, never listed, loaded or pruned by count),
so that neither a restart nor ``keep`` mixes the two histories (a restart resumed the
abandoned 30 after a rollback to 20 and a commit of 25; a prune by step number kept 30
and deleted 20 or 25).

Crash safety: ``rollback.json`` (``{"base": N}``) is written atomically before the first
rename and removed after the last, and every listing of the saver first finishes a
rollback it finds (:func:`finish`): a crash anywhere leaves the old history whole (the
marker not yet written) or the new base set (the marker there, or its work done).
"""

from __future__ import annotations

import json
import logging
import os

from dlrover_core.atomic_io import atomic_write_json, fsync_dir
from dlrover_core.checkpoint.saver import committed_steps, step_dir_name
from dlrover_core.crashpoints import crashpoint, declare

log = logging.getLogger(__name__)

MARKER = "rollback.json"

declare("disk.rollback.marker", "io", "save",
        "rank 0 writes rollback.json before it sets the abandoned steps aside")
declare("disk.rollback.abandon", "io", "save",
        "rank 0 renames a committed step above the rollback's base to .abandoned")


def base(directory: str) -> int | None:
    """The base of an unfinished rollback (``rollback.json``), or ``None``."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return int(json.load(f)["base"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def visible_steps(directory: str) -> list[int]:
    """Committed steps, oldest first, without those an unfinished rollback abandons."""
    b = base(directory)
    steps = committed_steps(directory)
    return steps if b is None else [s for s in steps if s <= b]


def begin(directory: str, restored: int) -> list[int]:
    """Make ``restored`` the base: abandon every committed step above it (see the module
    docstring). Returns the steps set aside (``[]``: none above it, nothing written).

    Raises:
        OSError: the marker or a rename failed (the next listing finishes the rollback
            when the marker was written).
    """
    if not [s for s in committed_steps(directory) if s > restored]:
        return []
    crashpoint("disk.rollback.marker")
    atomic_write_json(os.path.join(directory, MARKER), {"base": int(restored)})
    return finish(directory)


def finish(directory: str) -> list[int]:
    """Finish an unfinished rollback (the marker's steps above its base set aside, then
    the marker removed); returns the steps set aside.

    Raises:
        OSError: a rename failed (the marker stays: the next call goes on).
    """
    b = base(directory)
    if b is None:
        return []
    gone = []
    for s in sorted(committed_steps(directory)):
        if s <= b:
            continue
        src = os.path.join(directory, step_dir_name(s))
        dst, k = f"{src}.abandoned", 1
        while os.path.exists(dst):
            k += 1
            dst = f"{src}.abandoned-{k}"
        crashpoint("disk.rollback.abandon")
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            continue
        gone.append(s)
    fsync_dir(directory)
    try:
        os.unlink(os.path.join(directory, MARKER))
    except FileNotFoundError:  # another rank without a group finished it
        pass
    fsync_dir(directory)
    if gone:
        log.warning("checkpoint steps %s of %s belong to the history abandoned by the "
                    "rollback to step %d: renamed .abandoned", gone, directory, b)
    return gone
