"""Which process is which: a ``(pid, start time)`` pair names one process on this
machine even when pids are reused (``/proc/<pid>/stat``, field 22: start time in clock
ticks since boot). The flash buffers' headers record the writer and the persister this
way (:mod:`.shm`)."""

from __future__ import annotations

import os


def proc_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot), or ``None`` when it is gone.
    A (pid, start) pair names one process even when pids are reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2:].split()
    try:
        if rest[0] in (b"Z", b"X"):  # zombie / dead
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int, start: int) -> bool:
    """Whether the process (``pid``, ``start``) is running on this machine."""
    return pid > 0 and proc_start(pid) == start


def my_identity() -> tuple[int, int]:
    pid = os.getpid()
    return pid, proc_start(pid) or 0


