"""Errors that cross process boundaries between workers and the JobMaster."""

from __future__ import annotations


class WorkloadError(RuntimeError):
    """User code raised inside a role instance.

    Attributes:
        role, rank: where. ``phase``: ``setup`` (before the first step) or ``run``.
        exc_type: qualified exception type name; ``message``; ``traceback``: the
        formatted traceback from the worker; ``step``: last reported step (-1: none).
    """

    def __init__(self, role: str, rank: int, phase: str, exc_type: str, message: str,
                 traceback: str, step: int = -1) -> None:
        super().__init__(f"{role}-{rank} raised {exc_type} during {phase}: {message}")
        self.role = role
        self.rank = rank
        self.phase = phase
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.step = step

    def __reduce__(self):  # keep attributes when Ray pickles it
        return (WorkloadError, (self.role, self.rank, self.phase, self.exc_type, self.message,
                                self.traceback, self.step))


class InvocationTimeout(TimeoutError):
    """A role-group call did not finish within its ``timeout`` (s)."""
