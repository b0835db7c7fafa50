"""One run per job directory and per checkpoint folder: an exclusive ``flock``.

``dlrover submit`` takes :class:`DirLock` on the job directory (``context.sqlite``,
``summary.json``, the logs) and on the checkpoint folder before it starts or joins
Ray, and holds it until it returns. A second submit that names the same directory
(another embedded cluster on the same machine, or a typo) fails at once with
:class:`DirInUseError`, naming the directory and the holder, before it touches a file
there. ``flock`` is released by the kernel when the holder dies, so a crashed run never
leaves a lock behind; the holder's pid, host and start time written into the lock file
are only for the message.

A job that goes on without its submit (``--no-wait``, or Ctrl-C on a joined cluster)
keeps its locks: the submit hands them over to a :class:`LockKeeper` actor on the
JobMaster's node, which holds them until the JobMaster reaches a terminal state (or
is gone). The handover leaves no gap a second submit could use: the submit writes a
handover marker (a token and a deadline, :data:`HANDOVER_S`) into each lock file
before it lets go, and until the deadline only the holder of the token may take the
lock (:meth:`DirLock.acquire`; anyone else gets :class:`DirInUseError`).

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
import threading
import time

log = logging.getLogger(__name__)

LOCK_NAME = ".dlrover-run.lock"
#: seconds a handed-over lock is reserved for its keeper (:meth:`DirLock.release`)
HANDOVER_S = 60.0


class DirInUseError(RuntimeError):
    """Another run holds the lock of a job directory or checkpoint folder.

    Attributes:
        directory: the locked directory. holder: what the holder wrote (``pid``,
            ``host``, ``job``, ``since``), ``{}`` when unreadable.
    """

    def __init__(self, directory: str, what: str, holder: dict) -> None:
        self.directory, self.holder = directory, holder
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (job "
               f"{holder.get('job', '?')!r}, since {holder.get('since', '?')}"
               + (f", {holder['by']}" if holder.get("by") else "")
               + (", handing it over to the job's lock keeper" if holder.get("handover")
                  else "") + ")"
               if holder else "another process (no holder recorded)")
        super().__init__(
            f"the {what} {directory} is in use by {who}: two runs must not share it (they "
            "would overwrite each other's state); wait for that run to end, stop it "
            "(`dlrover stop NAME`), or give this run another --job-dir / checkpoint.dir")


class DirLock:
    """Exclusive, non-blocking lock on ``directory`` (the file ``<directory>/.dlrover-run.lock``).

    Args:
        directory: created when missing. what: how the message calls it (``job
            directory``). job: the job's name, recorded for the message. by: who holds
            it, for the message (``None``: the submit).
    Raises:
        DirInUseError: from :meth:`acquire`, another process holds it.
    """

    def __init__(self, directory: str, what: str, job: str, by: str | None = None) -> None:
        self.directory = os.path.abspath(directory)
        self.what, self.job, self.by = what, job, by
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self, token: str | None = None) -> DirLock:
        """Take the lock. ``token``: the one a handover (:meth:`release`) named; a lock
        handed over under another token is refused until the handover's deadline.

        Raises:
            DirInUseError: another process holds it, or it is being handed over.
        """
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
        holder = _read_holder(fd)
        if holder.get("handover") not in (None, token) \
                and time.time() < float(holder.get("until", 0)):
            os.close(fd)  # reserved for the keeper: left as it is
            raise DirInUseError(self.directory, self.what, holder)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), **({"by": self.by}
                                                                 if self.by else {})}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self, handover: str | None = None) -> None:
        """Drop the lock (idempotent); the file stays (removing it would race a waiter).
        ``handover``: a token; the lock file then says that only :meth:`acquire` with
        that token may take the lock for the next :data:`HANDOVER_S` seconds."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                holder = _read_holder(fd)
                os.ftruncate(fd, 0)
                if handover:
                    os.pwrite(fd, json.dumps({**holder, "handover": handover,
                                              "until": time.time() + HANDOVER_S}).encode(), 0)
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


class LockKeeper:
    """Ray actor (threaded) that holds the locks of a job which goes on without its
    submit, until the job's JobMaster (``master_name`` in ``namespace``) reports a
    summary (a terminal state) or is gone for good; then it releases them and exits.

    Args:
        job: the job's name, recorded in the lock files.
    """

    def __init__(self, job: str, master_name: str, namespace: str) -> None:
        self.job, self.master_name, self.namespace = job, master_name, namespace
        self._locks: list[DirLock] = []

    def ready(self) -> int:
        """This actor's pid."""
        return os.getpid()

    def take(self, dirs: list[tuple[str, str]], token: str, timeout: float) -> dict:
        """Take the lock of every ``(directory, what)``, handed over under ``token``,
        trying for up to ``timeout`` s; then hold them while the job runs.
        Returns ``{"pid", "host"}``.

        Raises:
            DirInUseError: a lock could not be had in time (none is held then).
        """
        deadline = time.monotonic() + timeout
        for directory, what in dirs:
            lock = DirLock(directory, what, self.job, by="the lock keeper of the detached job")
            while True:
                try:
                    self._locks.append(lock.acquire(token=token))
                    break
                except DirInUseError:
                    if time.monotonic() > deadline:
                        self._release()
                        raise
                    time.sleep(0.01)
        threading.Thread(target=self._hold, name="lock-keeper", daemon=True).start()
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def _release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []

    def _hold(self) -> None:
        import ray

        try:
            master = ray.get_actor(self.master_name, namespace=self.namespace)
        except ValueError:
            master = None
        while master is not None:
            try:
                ray.get(master.wait.remote(30), timeout=90)
                if ray.get(master.status.remote(), timeout=60).get("summary") is not None:
                    break
            except ray.exceptions.ActorDiedError:
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(1.0)  # the master is restarting
        self._release()
        log.info("job %s ended: its directory locks are released", self.job)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
