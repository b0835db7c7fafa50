"""One run per job directory and per checkpoint folder: an exclusive ``flock``.

``dlrover submit`` takes :class:`DirLock` on the job directory (``context.sqlite``,
``summary.json``, the logs) and on the checkpoint folder before it starts or joins
Ray, and holds it until it returns. A second submit that names the same directory
(another embedded cluster on the same machine, or a typo) fails at once with
:class:`DirInUseError`, naming the directory and the holder, before it touches a file
there. ``flock`` is released by the kernel when the holder dies, so a crashed run never
leaves a lock behind; the holder's pid, host and start time written into the lock file
are only for the message.

``flock`` works between processes of one machine and, on NFSv4 / Lustre / most FUSE
file systems, between machines; on a file system without it, ``flock`` raises and the
lock is reported as not taken (a warning), never silently assumed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

log = logging.getLogger(__name__)

LOCK_NAME = ".dlrover-run.lock"


class DirInUseError(RuntimeError):
    """Another run holds the lock of a job directory or checkpoint folder.

    Attributes:
        directory: the locked directory. holder: what the holder wrote (``pid``,
            ``host``, ``job``, ``since``), ``{}`` when unreadable.
    """

    def __init__(self, directory: str, what: str, holder: dict) -> None:
        self.directory, self.holder = directory, holder
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (job "
               f"{holder.get('job', '?')!r}, since {holder.get('since', '?')})"
               if holder else "another process (no holder recorded)")
        super().__init__(
            f"the {what} {directory} is in use by {who}: two runs must not share it (they "
            "would overwrite each other's state); wait for that run to end, stop it "
            "(`dlrover stop NAME`), or give this run another --job-dir / checkpoint.dir")


class DirLock:
    """Exclusive, non-blocking lock on ``directory`` (the file ``<directory>/.dlrover-run.lock``).

    Args:
        directory: created when missing. what: how the message calls it (``job
            directory``). job: the job's name, recorded for the message.
    Raises:
        DirInUseError: from :meth:`acquire`, another process holds it.
    """

    def __init__(self, directory: str, what: str, job: str) -> None:
        self.directory = os.path.abspath(directory)
        self.what, self.job = what, job
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirInUseError(self.directory, self.what, holder) from None
            log.warning("could not lock the %s %s (%s): two runs in it would not be "
                        "detected", self.what, self.directory, exc)
            return self
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays (removing it would race a waiter)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
