"""Worker output into the job directory: the stdout and stderr of a role instance,
per attempt, rotated by size.

Layout: ``<job_dir>/logs/<role>-<rank>/attempt-<N>.log`` (the driver:
``logs/driver/attempt-<N>.log``); when a file reaches ``max_bytes`` it is renamed
``attempt-<N>.log.1`` (older ones shift to ``.2`` ... up to ``backups``, the oldest is
dropped), as ``logging.handlers.RotatingFileHandler`` does.

How: the process's file descriptors 1 and 2 are redirected (``os.dup2``) into a pipe
that a daemon thread reads; it appends every chunk to the current attempt's file and
also writes it to the previous stdout (Ray's worker log). ``submit --verbose`` shows
it by reading these files (:class:`dlrover_core.cli.logs.LogTail`). Output of C/C++
code (gloo, NCCL) is captured as well as Python's. stdout and stderr share one file,
interleaved as written. ``sys.stdout``/``sys.stderr`` are made line-buffered so that
a SIGKILL loses at most the unread part of the pipe.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import IO

from dlrover_core.observability.log_limits import (
    DEFAULT_LOG_BACKUPS,
    DEFAULT_LOG_MAX_BYTES,
    MIN_LOG_BYTES,
)

DEFAULT_MAX_BYTES = DEFAULT_LOG_MAX_BYTES
DEFAULT_BACKUPS = DEFAULT_LOG_BACKUPS
LOGS_DIR = "logs"
#: bytes the reading thread asks the pipe for at once
READ_BYTES = 65536


def instance_dir(job_dir: str, role: str, rank: int) -> str:
    """``<job_dir>/logs/<role>-<rank>`` (``logs/driver`` for the driver)."""
    name = role if role == "driver" else f"{role}-{rank}"
    return os.path.join(job_dir, LOGS_DIR, name)


def attempt_path(job_dir: str, role: str, rank: int, attempt: int) -> str:
    return os.path.join(instance_dir(job_dir, role, rank), f"attempt-{attempt}.log")


class RotatingFile:
    """An append-only file rotated at ``max_bytes`` (bytes) keeping ``backups`` old
    parts (``path.1`` newest ... ``path.<backups>`` oldest).

    Raises:
        ValueError: ``max_bytes`` < :data:`MIN_LOG_BYTES` (1024) or ``backups`` < 0.
    """

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS) -> None:
        if max_bytes < MIN_LOG_BYTES or backups < 0:
            raise ValueError(f"max_bytes={max_bytes} (>= {MIN_LOG_BYTES}) and "
                             f"backups={backups} (>= 0)")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._f: IO[bytes] = open(path, "ab")

    def write(self, data: bytes) -> None:
        while data:
            room = self.max_bytes - self._f.tell()
            if room <= 0:
                self._rotate()
                continue
            # cut at the last newline that fits, so that lines stay whole when they can
            piece = data[:room]
            if len(data) > room:
                nl = piece.rfind(b"\n")
                if nl >= 0:
                    piece = piece[:nl + 1]
                elif self._f.tell() > 0:
                    self._rotate()
                    continue
            self._f.write(piece)
            data = data[len(piece):]
        self._f.flush()

    def _rotate(self) -> None:
        self._f.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._f = open(self.path, "ab")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class OutputCapture:
    """The process-wide capture; :func:`capture_output` makes and switches it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: RotatingFile | None = None
        self._pending: tuple[bytes, RotatingFile | None] | None = None
        self._switched = threading.Event()
        self._switches = 0
        #: the end of the last read when it may be the start of the pending marker (a
        #: marker can be split across two reads): held back until the next read
        self._held = b""
        self._tee_fd = os.dup(1)  # where stdout went before (Ray's worker log)
        r, w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self._read_fd = r
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - not a TextIOWrapper
                pass
        self._thread = threading.Thread(target=self._pump, name="dlrover-log-capture",
                                        daemon=True)
        self._thread.start()
        self._pid = os.getpid()
        atexit.register(self.close)

    def close(self) -> None:
        """At exit: wait (at most 5 s) until the thread has copied what is still in the
        pipe to the current file, then close it, so a process that ends right after
        printing keeps its last lines in its attempt's file (the daemon thread would
        stop with them unread). Later output still goes to the previous stdout. A
        forked child (which has no capture thread) does nothing, nor one whose thread
        has ended (the pipe closed: nothing would read the marker)."""
        if os.getpid() == self._pid and self._thread.is_alive():
            self._switch_to(None)

    def switch(self, path: str, max_bytes: int, backups: int) -> None:
        """Send output from now on to ``path`` (a new attempt's file). Output written
        before the call (by this process or a child sharing its descriptors) that is
        still in the pipe goes to the previous file: a marker written through the pipe
        tells the reading thread where the switch is (FIFO order), also when it arrives
        split across two reads; if the marker is not seen within 5 s the switch happens
        anyway."""
        self._switch_to(RotatingFile(path, max_bytes, backups))

    def _switch_to(self, new: RotatingFile | None) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        with self._lock:
            if self._file is None:
                self._file = new
                return
            self._switches += 1
            marker = b"\0dlrover-log-switch-%d\0" % self._switches
            self._pending = (marker, new)
            self._switched.clear()
        try:
            os.write(1, marker)  # under PIPE_BUF: one atomic write
        except OSError:
            pass
        if not self._switched.wait(5.0):
            with self._lock:
                if self._pending is not None and self._pending[1] is new:
                    held, self._held = self._held, b""
                    self._write(held)  # not the marker after all: it was output
                    self._tee(held)
                    self._swap(new)

    def _swap(self, new: RotatingFile | None) -> None:
        """Make ``new`` the current file (lock held)."""
        old, self._file, self._pending = self._file, new, None
        if old is not None:
            old.close()
        self._switched.set()

    def _write(self, data: bytes) -> None:
        """Append ``data`` to the current file (lock held)."""
        if self._file is not None and data:
            try:
                self._file.write(data)
            except OSError:
                pass

    def _tee(self, data: bytes) -> None:
        """Copy ``data`` to where stdout went before (Ray's worker log)."""
        try:
            if data:
                os.write(self._tee_fd, data)
        except OSError:
            pass

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, READ_BYTES)
            except OSError:
                data = b""
            eof = not data
            with self._lock:
                data, self._held = self._held + data, b""
                pending = self._pending
                if pending is not None and pending[0] in data:
                    before, _, after = data.partition(pending[0])
                    self._write(before)
                    self._swap(pending[1])
                    self._write(after)
                    data = before + after
                else:
                    if pending is not None and not eof:
                        keep = _marker_start(data, pending[0])
                        if keep:
                            data, self._held = data[:-keep], data[-keep:]
                    self._write(data)
            self._tee(data)
            if eof:
                return


def _marker_start(data: bytes, marker: bytes) -> int:
    """The length of the longest end of ``data`` that is a proper start of ``marker``
    (0: none), i.e. how many bytes may be the first part of a marker split across two
    reads."""
    for n in range(min(len(data), len(marker) - 1), 0, -1):
        if data.endswith(marker[:n]):
            return n
    return 0


_capture: OutputCapture | None = None
_capture_lock = threading.Lock()


def capture_output(job_dir: str, role: str, rank: int, attempt: int,
                   options: dict | None = None) -> str | None:
    """From now on, this process's stdout and stderr go to the attempt's log file (and
    still to where they went before). Call again at every (re)start: the next attempt
    gets its own file. Returns the file's path, or ``None`` when ``job_dir`` is empty
    or ``options["worker_logs"]`` is false.

    Args:
        options: the job's ``observability`` section (a dict; ``WorkerContext`` and
            ``TrainerContext`` carry it): ``worker_logs`` (bool), ``log_max_bytes``
            (bytes per file), ``log_backups`` (rotated files kept).
    """
    options = options or {}
    if not job_dir or not options.get("worker_logs", True):
        return None
    global _capture
    path = attempt_path(job_dir, role, rank, attempt)
    with _capture_lock:
        if _capture is None:
            _capture = OutputCapture()
        _capture.switch(path, int(options.get("log_max_bytes") or DEFAULT_MAX_BYTES),
                        int(options.get("log_backups", DEFAULT_BACKUPS)))
    return path
