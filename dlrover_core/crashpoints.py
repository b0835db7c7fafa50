"""Numbered crash points: where a checkpoint's save, persist, commit, prune or load can
be made to die or fail, for the crash-point harness (``make crash-test``,
``scripts/crash_test.py``). Imports nothing heavy.

Like SQLite's crash tests, every point where a process can die or a call can fail is
named once in :data:`POINTS`, and the code calls :func:`crashpoint` there. Disarmed (the
default) a call costs one global read. Armed, through the environment of the process
(so a child process, a Ray actor started with the same ``env_vars``, or a restarted
persister inherits it) or :func:`arm` in-process, the ``nth`` hit of the named point
injects the fault:

``sigkill``
    ``SIGKILL`` of the calling process (every thread dies at that instruction).
``enospc`` / ``eio``
    ``OSError`` with that errno raised at the point, as the write, fsync or rename there
    would raise it on a full or failing disk (points of kind ``io``).
``rmlock``
    the lock file handed to the point is removed (points of kind ``lock``); the call
    then returns and the code goes on, as after a user's ``rm``.

Environment:
    ``DLROVER_CRASHPOINT``        ``name`` or ``name@nth`` (1-based hit count)
    ``DLROVER_CRASHPOINT_FAULT``  one of :data:`FAULTS` (default ``sigkill``)
    ``DLROVER_CRASHPOINT_TRACE``  a file: every hit appends ``pid name`` (one line),
                                  so a harness can tell which points a run reached
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

FAULTS = ("sigkill", "enospc", "eio", "rmlock")


@dataclass(frozen=True)
class Point:
    """One crash point. ``kind``: ``io`` (a write, fsync, rename or unlink: every fault
    but ``rmlock``), ``lock`` (a lock taken or released: ``sigkill`` and ``rmlock``),
    ``state`` (a state change in memory or shared memory: ``sigkill`` only).
    ``area``: ``save``, ``persist``, ``commit``, ``prune``, ``load``."""

    name: str
    kind: str
    area: str
    doc: str

    @property
    def faults(self) -> tuple[str, ...]:
        return {"io": ("sigkill", "enospc", "eio"), "lock": ("sigkill", "rmlock"),
                "state": ("sigkill",)}[self.kind]


#: every crash point, by name; a :func:`crashpoint` call with another name raises
POINTS: dict[str, Point] = {}


def declare(name: str, kind: str, area: str, doc: str) -> Point:
    """Register a crash point (at import of the module that calls it).

    Raises:
        ValueError: a name declared twice, or a kind or area not allowed.
    """
    if name in POINTS:
        raise ValueError(f"crash point {name!r} declared twice")
    if kind not in ("io", "lock", "state"):
        raise ValueError(f"crash point {name!r}: kind {kind!r}; allowed: io, lock, state")
    if area not in ("save", "persist", "commit", "prune", "load"):
        raise ValueError(f"crash point {name!r}: area {area!r}; allowed: save, persist, "
                         "commit, prune, load")
    POINTS[name] = p = Point(name, kind, area, doc)
    return p


_armed: tuple[str, int, str] | None = None
_trace: str | None = None
_hits: dict[str, int] = {}


def arm(name: str | None, fault: str = "sigkill", nth: int = 1,
        trace: str | None = None) -> None:
    """Arm ``name`` (``None``: disarm) in this process; ``trace``: a file every hit is
    appended to (``None``: no trace). Hit counts start again from 0.

    Raises:
        ValueError: an unknown fault, or ``nth`` below 1.
    """
    global _armed, _trace
    if fault not in FAULTS:
        raise ValueError(f"crash point fault {fault!r}; allowed: {', '.join(FAULTS)}")
    if nth < 1:
        raise ValueError(f"crash point hit number {nth}; allowed: 1 or more")
    _armed = None if name is None else (name, int(nth), fault)
    _trace = trace
    _hits.clear()


def _from_env() -> None:
    spec = os.environ.get("DLROVER_CRASHPOINT", "")
    name, _, nth = spec.partition("@")
    arm(name or None, os.environ.get("DLROVER_CRASHPOINT_FAULT", "sigkill") or "sigkill",
        int(nth or 1), os.environ.get("DLROVER_CRASHPOINT_TRACE") or None)


def crashpoint(name: str, path: str | None = None) -> None:
    """Mark the crash point ``name`` (declared in :data:`POINTS`) and, when it is armed
    and this is its ``nth`` hit, inject the fault. ``path``: the lock file of a ``lock``
    point (removed by ``rmlock``).

    Raises:
        OSError: ``ENOSPC`` or ``EIO`` when armed so.
        KeyError: ``name`` was never declared (only checked while tracing or armed).
    """
    if _armed is None and _trace is None:
        return
    point = POINTS[name]
    n = _hits[name] = _hits.get(name, 0) + 1
    if _trace is not None:
        with open(_trace, "a") as f:
            f.write(f"{os.getpid()} {name}\n")
    if _armed is None or _armed[0] != name or _armed[1] != n:
        return
    fault = _armed[2]
    if fault not in point.faults:
        return
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "rmlock":
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    else:
        code = errno.ENOSPC if fault == "enospc" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (crash point {name})")


_from_env()
