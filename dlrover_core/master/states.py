"""The job's states and the table of allowed transitions.

The JobMaster's controller changes state only through ``JobController._set_state``,
which calls :func:`check_transition` first: a transition outside ``TRANSITIONS`` is a
bug in the master and raises ``IllegalTransitionError``.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """A job's state; compares equal to its string (``JobState.RUNNING == "running"``)."""

    PENDING = "pending"        # master created, nothing placed
    PLACING = "placing"        # placement groups being created
    STARTING = "starting"      # actors created, rendezvous and setup() running
    RUNNING = "running"        # roles (and driver) running
    RECOVERING = "recovering"  # a failover in progress
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


#: Allowed transitions. PENDING/PLACING -> RECOVERING: a master restarted while the job
#: was being placed starts over from there. RECOVERING -> PLACING: a node-level recovery
#: re-places every role; RECOVERING -> STARTING: a job-level recovery restarts them all.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PLACING, JobState.RECOVERING, JobState.FAILED,
                                 JobState.STOPPED}),
    JobState.PLACING: frozenset({JobState.STARTING, JobState.RECOVERING, JobState.FAILED,
                                 JobState.STOPPED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.FAILED,
                                  JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED,
                                 JobState.STOPPED}),
    JobState.RECOVERING: frozenset({JobState.PLACING, JobState.STARTING, JobState.RUNNING,
                                    JobState.FAILED, JobState.STOPPED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A state change that ``TRANSITIONS`` does not allow (a bug in the master)."""


def check_transition(old: JobState, new: JobState) -> None:
    """Raise ``IllegalTransitionError`` unless ``old -> new`` is in ``TRANSITIONS``."""
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old])) or "none (terminal)"
        raise IllegalTransitionError(
            f"illegal job transition {old.value} -> {new.value}; allowed from "
            f"{old.value}: {allowed}")
