"""The instance table: one ``Instance`` per role rank (and one for the driver), the
only model of what the master knows about each actor, and its row in the JobContext.

``Instance.record()`` is the persisted part (role, rank, actor name, node, pid, state,
attempt, last step); the table writes it on every state change and writes the
``last_step`` of reporting instances on a timer (:meth:`InstanceTable.flush_progress`),
so that a restarted master reads back where each instance was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlrover_core.master.context import JobContext

#: The role name of the driver (the ``BaseTrainer`` of an MPMD job); rank 0.
DRIVER = "driver"


class InstanceState(StrEnum):
    """Where one instance is; compares equal to its string."""

    PENDING = "pending"      # known, no actor yet
    STARTING = "starting"    # actor created; rendezvous and setup() running
    RUNNING = "running"      # set up; running its loop or serving the driver
    SUCCEEDED = "succeeded"  # its run() returned
    FAILED = "failed"        # failed; a recovery replaces it
    KILLED = "killed"        # killed by the master (recovery)
    STOPPED = "stopped"      # shut down at the end of the job


@dataclass
class Instance:
    """A role rank (or the driver) as the master tracks it.

    Attributes:
        handle: the Ray actor handle (``None`` when a restarted master cannot find it).
        generation: bumped every time the ``(role, rank)`` slot gets a new actor or is
            set up again in place; results of an older generation are ignored.
        last_report_ts: unix s of the last step report (hang detection).
        last_step_ts: unix s, worker's clock, when ``last_step`` ended (hang blame).
        info: what ``WorkloadHost.node_info()`` returned.
    """

    role: str
    rank: int
    handle: Any = None
    actor_name: str = ""
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    attempt: int = 0
    state: InstanceState = InstanceState.PENDING
    last_step: int = -1
    last_report_ts: float = 0.0
    #: a step report arrived since this attempt's setup (a script role's rank is
    #: watched for hangs only from its first report: a plain script reports none)
    reported: bool = False
    #: unix s (the worker's clock) when ``last_step`` ended, as its report said
    last_step_ts: float = 0.0
    generation: int = 0
    info: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.role, self.rank)

    @property
    def label(self) -> str:
        return self.role if self.role == DRIVER else f"{self.role}-{self.rank}"

    @property
    def phase(self) -> str:
        """``run`` once it reported a step, else ``setup``."""
        return "run" if self.last_step >= 0 else "setup"

    def record(self) -> dict:
        """The persisted row (``master.context.INSTANCE_COLUMNS``)."""
        return {"role": self.role, "rank": self.rank, "actor_name": self.actor_name,
                "node_id": self.node_id, "pid": self.pid, "state": self.state.value,
                "attempt": self.attempt, "last_step": self.last_step}

    @classmethod
    def from_record(cls, row: dict) -> Instance:
        """An instance (no handle yet) from a persisted row."""
        return cls(row["role"], row["rank"], None, row["actor_name"], row["node_id"],
                   pid=row["pid"], attempt=row["attempt"], state=InstanceState(row["state"]),
                   last_step=row["last_step"])


class InstanceFailure(Exception):
    """An instance failed while the master was starting or setting it up."""

    def __init__(self, inst: Instance, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.inst = inst
        self.exc = exc


class InstanceTable:
    """The job's instances, keyed by ``(role, rank)``, plus the driver; persisted in
    the JobContext. Not thread-safe by itself: the controller thread changes it, and
    ``report`` only touches ``last_step``/``last_report_ts`` of existing entries."""

    def __init__(self, context: JobContext) -> None:
        self.context = context
        self.roles: dict[tuple[str, int], Instance] = {}
        self.driver: Instance | None = None
        self._progress_dirty: set[tuple[str, int]] = set()

    # ------------------------------------------------------------------ lookup
    def get(self, role: str, rank: int) -> Instance | None:
        return self.driver if role == DRIVER else self.roles.get((role, rank))

    def all(self) -> list[Instance]:
        """Role instances (by role, rank) and then the driver."""
        out = list(self.roles.values())
        if self.driver is not None:
            out.append(self.driver)
        return out

    def of_role(self, role: str, world_size: int) -> list[Instance]:
        return [self.roles[(role, k)] for k in range(world_size)]

    def is_current(self, inst: Instance) -> bool:
        """True while ``inst`` is the table's entry for its slot (not replaced)."""
        return self.get(inst.role, inst.rank) is inst

    # ------------------------------------------------------------------ changes
    def register(self, role: str, rank: int, handle: Any, actor_name: str,
                 attempt: int) -> Instance:
        """Make ``handle`` the new generation of slot ``(role, rank)`` (state
        ``starting``) and persist it."""
        prev = self.get(role, rank)
        inst = Instance(role, rank, handle, actor_name, attempt=attempt,
                        state=InstanceState.STARTING,
                        generation=(prev.generation + 1) if prev else 0)
        if role == DRIVER:
            self.driver = inst
        else:
            self.roles[(role, rank)] = inst
        self.context.put_instance(inst.record())
        return inst

    def adopt(self, inst: Instance) -> None:
        """Put an instance read back from the context into the table (re-attach)."""
        if inst.role == DRIVER:
            self.driver = inst
        else:
            self.roles[inst.key] = inst

    def set_state(self, inst: Instance, state: InstanceState) -> None:
        """Change and persist ``inst.state`` (with its attempt and last step)."""
        inst.state = state
        self.persist(inst, "state", "attempt", "last_step")

    def set_node(self, inst: Instance, info: dict) -> None:
        """Record where the actor runs (``WorkloadHost.node_info()``) and persist it."""
        inst.node_id, inst.ip, inst.pid, inst.info = (info["node_id"], info["ip"], info["pid"],
                                                      info)
        self.persist(inst, "node_id", "pid")

    def persist(self, inst: Instance, *columns: str) -> None:
        row = inst.record()
        self.context.update_instance(inst.role, inst.rank, **{c: row[c] for c in columns})

    def note_report(self, role: str, rank: int, step: int,
                    ts: float | None = None) -> Instance | None:
        """A step report arrived (``ts``: unix s, the worker's clock, when ``step``
        ended): remember the arrival time, and the step (persisted by
        :meth:`flush_progress`) with ``ts`` unless the instance already holds a step
        that ended later in this attempt: a report overtaken by a newer one (Ray runs
        the master's calls out of order; a rank that dropped its node's agent reports
        directly while the agent may still forward older steps) moves nothing back."""
        inst = self.get(role, rank)
        if inst is not None:
            inst.last_report_ts = time.time()
            inst.reported = True
            if ts is None or ts >= inst.last_step_ts:
                inst.last_step = step
                if ts is not None:
                    inst.last_step_ts = ts
                self._progress_dirty.add(inst.key)
        return inst

    def flush_progress(self) -> int:
        """Write the ``last_step`` of every instance that reported since the last flush,
        in one transaction; returns how many rows it wrote."""
        keys, self._progress_dirty = self._progress_dirty, set()
        changes = []
        for role, rank in keys:
            inst = self.get(role, rank)
            if inst is not None:
                changes.append((role, rank, {"last_step": inst.last_step}))
        self.context.update_instances(changes)
        return len(changes)
