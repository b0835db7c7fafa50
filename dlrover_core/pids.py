"""Whether a process of this host runs, by its pid (Linux: zombies read from /proc)."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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
