"""``JobScope``: the pieces of one job that the master's components share (spec, graph,
plugin manager, event log, JobContext, instance table, failover policy, stop flag).

The controller builds one and hands it to the launcher, standby pool, monitor,
recovery executor and re-attach, so none of them reaches for a global.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from dlrover_core.runs import RunPaths

if TYPE_CHECKING:
    from dlrover_core.graph.graph import ComputationGraph
    from dlrover_core.master.context import JobContext
    from dlrover_core.master.events import EventLog
    from dlrover_core.master.failover import FailoverCoordinator
    from dlrover_core.master.instances import InstanceTable
    from dlrover_core.plugins.manager import PluginManager


class JobStopped(Exception):
    """``stop()`` was called: whatever the controller was doing ends, the job ends
    ``stopped``."""


@dataclass
class JobScope:
    """Shared state of one job's master. ``lock`` guards what ``report`` (another
    thread) and the controller both change: metrics, step, instance progress."""

    spec: DictConfig
    job_dir: str
    graph: ComputationGraph
    pm: PluginManager
    events: EventLog
    context: JobContext
    instances: InstanceTable
    failover: FailoverCoordinator
    run_id: str = ""
    #: the run's number in the job directory (:mod:`dlrover_core.runs`)
    run: int = 0
    #: role -> {"step", "source", "path"} of the checkpoint its rank 0 resumed from
    resumed_from: dict[str, dict] = field(default_factory=dict)
    #: unix s when the job started (kept across master restarts)
    started_at: float = field(default_factory=time.time)
    stop_event: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: role -> {method: InvocationOptions} from the instances' setup (for the driver)
    invocations: dict[str, dict] = field(default_factory=dict)
    #: role -> the step of its newest checkpoint (rank 0's report)
    checkpoint_steps: dict[str, int] = field(default_factory=dict)
    #: rank 0's newest step and metrics, and when each step was first seen (unix s)
    step: int = -1
    metrics: dict[str, float] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)
    #: node id -> the Ray actor name of the job's step-report agent on that node
    #: (:mod:`dlrover_core.runtime.node_reporter`), learnt from its forwards; a
    #: restarted master asks them for their ranks (:mod:`dlrover_core.master.reattach`)
    agents: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec.name)

    def check_stop(self) -> None:
        """Raise ``JobStopped`` once ``stop()`` was called."""
        if self.stop_event.is_set():
            raise JobStopped()

    def emit(self, event: str, **fields: Any) -> dict:
        """Append an event to ``events.jsonl``."""
        return self.events.emit(event, **fields)

    def failover_option(self, key: str) -> Any:
        return OmegaConf.select(self.spec, f"failover.{key}")

    @property
    def run_paths(self) -> RunPaths:
        """Where this (the latest) run's events, metrics, summary and logs go."""
        return RunPaths(self.job_dir, self.run, self.job_dir)

    def path(self, *parts: str) -> str:
        return os.path.join(self.job_dir, *parts)
