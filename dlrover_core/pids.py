"""Processes of this host by pid (Linux: read from /proc): alive (zombies are not),
the members of a process group, and what such a group started."""

from __future__ import annotations

import os

__all__ = ["descendants", "group_pids", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs: it exists (``os.kill(pid, 0)``; a
    process of another user counts) and is not a zombie (exited, not yet reaped, as
    ``/proc/<pid>/stat`` says). A ``pid`` <= 0 is never alive (``os.kill`` would
    address a process group there)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone since os.kill
        return False


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def descendants(pgids: list[int]) -> list:
    """The processes descended from the members of process groups ``pgids``, as
    ``psutil.Process`` objects (which check the start time before signalling): Ray
    starts its workers in sessions of their own, under the node's raylet."""
    import psutil

    procs = {}
    for pid in (p for g in pgids for p in group_pids(g)):
        try:
            procs.update((c.pid, c) for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return list(procs.values())
