"""Named states of a job (the JobMaster is an explicit state machine)."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
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


#: Allowed transitions; anything else is a bug in the master.
TRANSITIONS: dict[JobState, set[JobState]] = {
    JobState.PENDING: {JobState.PLACING, JobState.FAILED, JobState.STOPPED},
    JobState.PLACING: {JobState.STARTING, JobState.FAILED, JobState.STOPPED},
    JobState.STARTING: {JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.STOPPED},
    JobState.RUNNING: {JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED},
    JobState.RECOVERING: {JobState.PLACING, JobState.STARTING, JobState.RUNNING, JobState.FAILED,
                          JobState.STOPPED},
    JobState.SUCCEEDED: set(),
    JobState.FAILED: set(),
    JobState.STOPPED: set(),
}
