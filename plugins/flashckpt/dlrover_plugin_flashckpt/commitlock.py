"""The commit lock of one step (``<dir>/.step_<step>.commit``): one committer at a time,
on any number of hosts sharing the checkpoint directory. Imports no torch.

The lock file holds a **lease**: ``{"host", "pid", "start", "nonce", "time"}``
(``start``: the process start time in clock ticks, :func:`.identity.proc_start`, so a
reused pid is not taken for the holder; ``time``: for people reading the file, never
compared). It is created whole (written to a file of its own, then hard-linked to the
lock's name: ``link`` fails when the name exists), so a reader never sees half a lease
(``O_EXCL`` and a write on a filesystem without hard links).

Takeover rule (:func:`take`): a lease is taken over when its holder is gone:

- on this host, at once when the process ``(pid, start)`` no longer runs;
- otherwise (another host's lease, or a holder here that still runs but hangs), when
  this process has seen that exact lease (its ``nonce``) unchanged for
  :data:`LOCK_STALE_S` on its own monotonic clock. Another host's wall clock is never
  compared with ours.

A takeover renames the lock to a name of its own first and checks that the file it
moved is the lease it judged (:func:`take_over`); when another taker replaced it
meanwhile, the moved lock is put back and the takeover gives up, so two takers never
both win.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from typing import Iterator

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_core.pids import pid_alive
from dlrover_plugin_flashckpt.identity import alive, my_identity

log = logging.getLogger(__name__)

#: seconds a lease is seen unchanged before it is taken over from a holder this host
#: cannot check (another host's, or a live one here): a commit holds the lock for a
#: manifest write and a few renames
LOCK_STALE_S = 300.0

declare("flash.commit.lock_take", "lock", "commit",
        "the commit lock of a step was just taken (the lease is in place)")
declare("flash.commit.lock_release", "lock", "commit",
        "the commit lock is about to be released (the commit is over)")

#: lock path -> (the lease's key, monotonic time this process first saw it)
_seen: dict[str, tuple[str, float]] = {}


def lock_path(directory: str, step: int) -> str:
    """The commit lock of ``step`` in the checkpoint directory ``directory`` (beside
    the step's temp directory, so it is held across the move of that directory)."""
    return os.path.join(directory, f".step_{step:08d}.commit")


def my_lease() -> dict:
    pid, start = my_identity()
    return {"host": socket.gethostname(), "pid": pid, "start": start,
            "nonce": os.urandom(8).hex(), "time": time.time()}


def read_lease(path: str) -> dict | None:
    """The lease in the lock file ``path``; ``None`` when there is none. An unreadable
    file (damaged) reads as ``{"unreadable": "<inode>-<size>-<mtime_ns>"}``: it is
    judged like a lease of another host by that key."""
    try:
        with open(path) as f:
            text = f.read()
        lease = json.loads(text)
        if not isinstance(lease, dict) or "nonce" not in lease:
            raise ValueError("not a lease")
        return lease
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return {"unreadable": f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"}


def _key(lease: dict) -> str:
    return str(lease.get("nonce") or lease.get("unreadable"))


def holder_gone(path: str, lease: dict) -> bool:
    """Whether the holder of ``lease`` (read from ``path``) is gone: see the module
    docstring. Records the first sight of a lease (per ``path``) on the monotonic
    clock."""
    if lease.get("host") == socket.gethostname() and lease.get("pid"):
        pid, start = int(lease["pid"]), lease.get("start")
        if not (pid_alive(pid) if start is None else alive(pid, int(start))):
            return True
    now = time.monotonic()
    seen = _seen.get(path)
    if seen is None or seen[0] != _key(lease):
        _seen[path] = (_key(lease), now)
        return False
    return now - seen[1] >= LOCK_STALE_S


def take_over(path: str, judged: dict) -> bool:
    """Remove the lock ``path`` judged stale (``judged``: the lease read before the
    judgement), unless it is no longer that lease: it is moved to a name of its own
    first, and put back when another taker's fresh lease was moved instead. Returns
    whether the judged lease was removed."""
    grab = f"{path}.stale-{os.urandom(8).hex()}"
    try:
        os.rename(path, grab)
    except OSError:
        return False
    moved = read_lease(grab)
    if moved is None or _key(moved) != _key(judged):  # not the lease judged: give it back
        try:
            os.link(grab, path)
        except OSError:
            pass
        os.unlink(grab)
        return False
    os.unlink(grab)
    _seen.pop(path, None)
    return True


def _create(path: str, lease: dict) -> bool:
    """Put ``lease`` at ``path`` whole; False when a lock is there already.

    Raises:
        OSError: the lease could not be written (a full disk: ``ENOSPC``)."""
    own = f"{path}.new-{lease['nonce']}"
    try:
        with open(own, "x") as f:
            json.dump(lease, f)
        try:
            os.link(own, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _create_exclusive(path, lease)  # a filesystem without hard links
        return True
    finally:
        try:
            os.unlink(own)
        except OSError:
            pass


def _create_exclusive(path: str, lease: dict) -> bool:
    """:func:`_create` where hard links are not supported: ``O_EXCL`` and a write (a
    reader may see the file empty for a moment; it is judged by its inode then)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(lease, f)
    return True


def take(path: str) -> dict | None:
    """Take the commit lock ``path``; returns this process's lease, or ``None`` when a
    live holder has it (or a takeover lost a race).

    Raises:
        OSError: the lease could not be written (``ENOSPC``, ``EIO``)."""
    me = my_lease()
    for _ in range(3):
        if _create(path, me):
            crashpoint("flash.commit.lock_take", path=path)
            return me
        owner = read_lease(path)
        if owner is None:
            continue  # released meanwhile
        if not holder_gone(path, owner):
            return None
        if not take_over(path, owner):
            return None
        log.warning("took over the commit lock %s (held by %s)", path, owner)
    return None


@contextlib.contextmanager
def held(directory: str, step: int) -> Iterator[tuple[str, dict] | None]:
    """The commit lock of ``step`` in ``directory`` for a ``with`` block: ``(path,
    lease)`` when :func:`take` got it, else ``None`` (a live holder has it); a lock taken
    is released (:func:`release`) when the block ends, however it ends.

    Raises:
        OSError: as :func:`take`."""
    path = lock_path(directory, step)
    lease = take(path)
    if lease is None:
        yield None
        return
    try:
        yield path, lease
    finally:
        release(path, lease)


def holds(path: str, lease: dict) -> bool:
    """Whether the lock ``path`` still holds ``lease`` (not removed nor taken over)."""
    now = read_lease(path)
    return now is not None and now.get("nonce") == lease["nonce"]


def release(path: str, lease: dict) -> None:
    """Remove the lock ``path`` when it still holds ``lease``; a lock removed or taken
    over meanwhile is left alone."""
    crashpoint("flash.commit.lock_release", path=path)
    take_over(path, lease)  # moved aside first: a lease put there meanwhile stays
    _seen.pop(path, None)
