"""A marker for tests of the data plane: a :class:`Tracer` put into a payload (a
rollout batch, an encoder's output, a weights message) appends ``<tag> <pid>`` to a
file in every process that unpickles it, so a test can tell which processes the data
went through (worker to worker, or through the driver). The toy problems of the
template plugins use it."""

from __future__ import annotations

import os


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
