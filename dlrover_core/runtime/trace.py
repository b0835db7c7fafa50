"""A marker for tests of the data plane: a :class:`Tracer` put into a payload (a
rollout batch, an encoder's output, a weights message) appends ``<tag> <pid>`` to a
file in every process that unpickles it, so a test can tell which processes the data
went through (worker to worker, or through the driver); :func:`read_traces` reads the
file back. The toy problems of the template plugins use it."""

from __future__ import annotations

import os
from collections import defaultdict


def _trace_loaded(path: str, tag: str) -> Tracer:
    """Unpickling a :class:`Tracer`: append ``<tag> <pid>`` to ``path`` (one
    ``O_APPEND`` write, so lines from several processes do not interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{tag} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return Tracer(path, tag)


class Tracer:
    """Logs ``<tag> <pid>`` to ``path`` in each process that unpickles it."""

    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = path, tag

    def __reduce__(self) -> tuple:
        return (_trace_loaded, (self.path, self.tag))


def read_traces(path: str) -> dict[str, set[int]]:
    """What :class:`Tracer` wrote to ``path``: tag -> the pids of the processes that
    unpickled a payload carrying it; a tag never written (or a file that does not exist)
    gives an empty set."""
    seen: dict[str, set[int]] = defaultdict(set)
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                tag, pid = line.split()
                seen[tag].add(int(pid))
    return seen
