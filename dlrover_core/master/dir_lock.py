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

A lock file removed (``rm``) or replaced (another file renamed onto it) while held
must not let a second run in. Three parts, each for one way in:

* **Two locks.** :meth:`DirLock.acquire` takes the ``flock`` of the lock file *and* an
  exclusive ``flock`` of the directory itself (an ``O_RDONLY`` descriptor of it). A
  directory is not removed by ``rm`` of a file in it, so a second process on the same
  machine that finds a new lock file still meets the directory's lock, and gets
  :class:`DirInUseError` ("its lock file was removed or replaced"). The directory's
  lock is only relied on between processes of one machine (on NFS the kernel keeps a
  directory's ``flock`` on the client); the lock file's lock is the one that reaches
  other machines. Where a directory cannot be locked (``flock`` raises another error
  than "held"), the lock file's lock is taken alone.
* **Inode re-check at acquire.** After the lock file's ``flock`` is taken, the path
  must still name the file locked (``st_dev`` + ``st_ino`` of ``fstat`` of the
  descriptor against ``lstat`` of the path); when it does not (removed or replaced
  between our ``open`` and ``flock``, e.g. while another host took the new file), the
  new file is opened and locked instead, up to :data:`REOPEN_TRIES` times.
* **The holder notices a loss.** :meth:`DirLock.check` re-stats the directory and the
  lock file and raises :class:`LockLostError` when either is gone or another inode
  than the one locked. The :class:`LockKeeper` checks each round of its wait on the
  JobMaster (at most every 30 s) and logs the loss as an error naming the directory.
  A lock file removed on NFS lets a process on *another* host take the new file: only
  this check sees that, after the fact.

``flock`` works between processes of one machine. On NFS (Linux 2.6.12 and later) the
client turns a file's ``flock`` into a whole-file byte-range lock held by the server,
so it excludes other hosts, unless the mount keeps locks local (``nolock``,
``local_lock=flock`` or ``local_lock=all``): then two hosts can both hold it and
nothing here notices. On a file system without ``flock`` it raises, and the lock is
reported as not taken (a warning), never silently assumed.
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
#: times :meth:`DirLock.acquire` opens the lock file again when its path named another
#: file once the ``flock`` was taken
REOPEN_TRIES = 5
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class DirInUseError(RuntimeError):
    """Another run holds the lock of a job directory or checkpoint folder.

    Attributes:
        directory: the locked directory. holder: what the holder wrote (``pid``,
            ``host``, ``job``, ``since``), ``{}`` when unreadable or lost (``who`` then
            says why).
    """

    def __init__(self, directory: str, what: str, holder: dict,
                 who: str = "another process (no holder recorded)") -> None:
        self.directory, self.holder = directory, holder
        if holder:
            who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (job "
                   f"{holder.get('job', '?')!r}, since {holder.get('since', '?')}"
                   + (f", {holder['by']}" if holder.get("by") else "")
                   + (", handing it over to the job's lock keeper" if holder.get("handover")
                      else "") + ")")
        super().__init__(
            f"the {what} {directory} is in use by {who}: two runs must not share it (they "
            "would overwrite each other's state); wait for that run to end, stop it "
            "(`dlrover stop NAME`), or give this run another --job-dir / checkpoint.dir")


class LockLostError(RuntimeError):
    """The holder of a :class:`DirLock` lost it: its lock file or directory was
    removed or replaced while held (:meth:`DirLock.check`).

    Attributes:
        directory: the locked directory. what: how it is called (``job directory``).
        happened: what was found (``the lock file ... was removed``).
    """

    def __init__(self, directory: str, what: str, happened: str) -> None:
        self.directory, self.what, self.happened = directory, what, happened
        super().__init__(
            f"the run lock of the {what} {directory} is lost: {happened}; a second run may "
            f"now take the {what} and overwrite this run's state. Do not remove "
            f"{LOCK_NAME} while a job runs; make sure no other run uses {directory} "
            "(`dlrover list`, `dlrover status NAME`) and stop one of them if one does")


class DirLock:
    """Exclusive, non-blocking lock on ``directory``: the ``flock`` of the file
    ``<directory>/.dlrover-run.lock`` and of the directory itself (module docstring).

    Args:
        directory: created when missing. what: how the message calls it (``job
            directory``). job: the job's name, recorded for the message. by: who holds
            it, for the message (``None``: the submit).
    Raises:
        DirInUseError: from :meth:`acquire`, another process holds it.
        LockLostError: from :meth:`check`, the lock file or directory was removed or
            replaced while held.
    """

    def __init__(self, directory: str, what: str, job: str, by: str | None = None) -> None:
        self.directory = os.path.abspath(directory)
        self.what, self.job, self.by = what, job, by
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._fd: int | None = None
        self._dir_fd: int | None = None

    def acquire(self, token: str | None = None) -> DirLock:
        """Take the lock. ``token``: the one a handover (:meth:`release`) named; a lock
        handed over under another token is refused until the handover's deadline.

        Raises:
            DirInUseError: another process holds the lock file or the directory (the
                lock file then was removed or replaced while held), the lock file
                changed :data:`REOPEN_TRIES` times while it was being locked, or the
                lock is being handed over.
        """
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(REOPEN_TRIES):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in _BUSY:
                    raise DirInUseError(self.directory, self.what, holder) from None
                log.warning("could not lock the %s %s (%s): two runs in it would not be "
                            "detected", self.what, self.directory, exc)
                return self
            if _changed(fd, self.path) is None:
                break
            os.close(fd)  # the path names another file now: lock that one
        else:
            raise DirInUseError(self.directory, self.what, {}, who=(
                f"another process (its lock file {self.path} was removed or replaced "
                f"{REOPEN_TRIES} times while this run locked it)"))
        dir_fd = self._lock_directory(fd)
        holder = _read_holder(fd)
        if holder.get("handover") not in (None, token) \
                and time.time() < float(holder.get("until", 0)):
            _close(fd, dir_fd)  # reserved for the keeper: left as it is
            raise DirInUseError(self.directory, self.what, holder)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), **({"by": self.by}
                                                                 if self.by else {})}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd, self._dir_fd = fd, dir_fd
        return self

    def _lock_directory(self, fd: int) -> int | None:
        """The directory's own ``flock`` (its descriptor), ``None`` where a directory
        cannot be locked. Raises DirInUseError (closing ``fd``) when another holds it."""
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.info("the %s %s cannot be opened to lock it (%s): its lock file alone "
                     "is locked", self.what, self.directory, exc)
            return None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(dir_fd)
            if exc.errno in _BUSY:
                os.close(fd)
                raise DirInUseError(self.directory, self.what, {}, who=(
                    f"another process that holds the directory's lock (its lock file "
                    f"{LOCK_NAME} was removed or replaced while it held it, so its pid and "
                    "host are not known)")) from None
            log.info("the %s %s cannot be locked itself (%s): its lock file alone is "
                     "locked", self.what, self.directory, exc)
            return None
        return dir_fd

    def check(self) -> None:
        """Make sure the lock is still this run's: the directory and the lock file at
        their paths are the ones locked. Does nothing when the lock is not held.

        Raises:
            LockLostError: either was removed or replaced (says which); the lock then
                protects nothing against a process that opens the path anew.
        """
        if self._fd is None:
            return
        happened = (_changed(self._dir_fd, self.directory, "directory")
                    if self._dir_fd is not None else None) \
            or _changed(self._fd, self.path, "lock file")
        if happened:
            raise LockLostError(self.directory, self.what, happened)

    def release(self, handover: str | None = None) -> None:
        """Drop the lock (idempotent); the file stays (removing it would race a waiter).
        ``handover``: a token; the lock file then says that only :meth:`acquire` with
        that token may take the lock for the next :data:`HANDOVER_S` seconds."""
        if self._fd is not None:
            fd, dir_fd, self._fd, self._dir_fd = self._fd, self._dir_fd, None, None
            try:
                holder = _read_holder(fd)
                os.ftruncate(fd, 0)
                if handover:
                    os.pwrite(fd, json.dumps({**holder, "handover": handover,
                                              "until": time.time() + HANDOVER_S}).encode(), 0)
            except OSError:
                pass
            _close(fd, dir_fd)  # closing the last descriptors releases the flocks

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _changed(fd: int, path: str, name: str = "lock file") -> str | None:
    """``None`` when ``path`` names the file open as ``fd`` (``st_dev`` + ``st_ino``),
    else what happened to it (for :class:`LockLostError`)."""
    held = os.fstat(fd)
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return f"its {name} {path} was removed"
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return (f"its {name} {path} was replaced (inode {now.st_ino}, the locked one was "
                f"{held.st_ino})")
    return None


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def live_holder(directory: str) -> dict | None:
    """Who holds ``directory``'s run lock, read without taking it: the lock file's
    record (``pid``, ``host``, ``job``, ``since``) when it names a process of this
    machine that is alive; ``None`` when the file is missing or unreadable, names another
    host (nothing here can tell) or a process that is gone (the lock died with it).

    Read only, so that ``dlrover list`` never makes a submit starting at that moment
    fail with :class:`DirInUseError`; a pid reused since the holder died reads as
    alive."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        holder = _read_holder(fd)
    finally:
        os.close(fd)
    try:
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return holder


class LockKeeper:
    """Ray actor (threaded) that holds the locks of a job which goes on without its
    submit, until the job's JobMaster (``master_name`` in ``namespace``) reports a
    summary (a terminal state) or is gone for good; then it releases them and exits.
    Each round of that wait (at most 30 s) it re-checks the locks (:meth:`check_locks`).

    Args:
        job: the job's name, recorded in the lock files.
    """

    def __init__(self, job: str, master_name: str, namespace: str) -> None:
        self.job, self.master_name, self.namespace = job, master_name, namespace
        self._locks: list[DirLock] = []
        self._reported: set[str] = set()

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

    def check_locks(self) -> list[LockLostError]:
        """Re-check every held lock (:meth:`DirLock.check`). A lost one is logged as an
        error naming its directory (once per directory) and returned; it stays held (its
        directory's lock still keeps out a second run on this machine)."""
        lost = []
        for lock in self._locks:
            try:
                lock.check()
            except LockLostError as exc:
                lost.append(exc)
                if lock.directory not in self._reported:
                    self._reported.add(lock.directory)
                    log.error("job %s: %s", self.job, exc)
        return lost

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
            self.check_locks()
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
