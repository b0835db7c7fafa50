"""The controller: the JobMaster's loop, one state at a time (after Ray Train v2's
controller).

:meth:`JobController.run` calls the handler of the current state; each handler
does that state's work and returns the next state (``None``: stay). Every state
change goes through :meth:`JobController._set_state`, which checks it against
``states.TRANSITIONS``, persists it in the JobContext and emits ``job_state_changed``.

- ``PENDING``: announce the job (``job_started``) -> ``PLACING``.
- ``PLACING``: the launcher creates the placement groups; the node check probes their
  nodes and places again without bad ones (``master.node_check``) -> ``STARTING``.
- ``STARTING``: the launcher starts every role, the driver, the spares -> ``RUNNING``
  (a failure -> ``RECOVERING``).
- ``RUNNING``: the monitor polls; all done -> ``SUCCEEDED``; a failure -> ``RECOVERING``.
- ``RECOVERING``: the failure is classified (plugins, then ``FailoverCoordinator``);
  ``fatal`` -> ``FAILED``; ``node`` -> ``PLACING`` and ``job`` -> ``STARTING`` after
  tearing everything down; ``process``/``role`` are carried out in place -> ``RUNNING``,
  except after a failure in ``STARTING``: the start-up is then done again as a whole
  (-> ``STARTING``), since some roles or the driver may not be up yet.

``stop()`` ends any state in ``STOPPED``; an error in the master ends it in ``FAILED``.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from typing import Any, Callable

import ray
from omegaconf import DictConfig, OmegaConf

from dlrover_core.atomic_io import atomic_write_json
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.master.context import JobContext
from dlrover_core.master.elastic import ElasticManager
from dlrover_core.master.elastic_room import restore_world_sizes
from dlrover_core.master.events import EventLog
from dlrover_core.master.failover import (
    FailoverCoordinator,
    JobFailed,
    RecoveryAction,
    what_was_running,
)
from dlrover_core.master.health import HealthWatch
from dlrover_core.master.instances import InstanceFailure, InstanceState, InstanceTable
from dlrover_core.master.launcher import Launcher
from dlrover_core.master.monitor import Detection, Monitor
from dlrover_core.master.node_check import NodeCheck
from dlrover_core.master.progress import ProgressRecorder
from dlrover_core.master.reattach import reattach
from dlrover_core.master.recovery import OpenRecovery, RecoveryExecutor
from dlrover_core.master.scope import JobScope, JobStopped
from dlrover_core.master.shards import ShardRegistry
from dlrover_core.master.standby import StandbyPool
from dlrover_core.master.stragglers import StragglerDetector
from dlrover_core.master.states import JobState, check_transition
from dlrover_core.observability.tensorboard import attach_tensorboard
from dlrover_core.placement import PlacementError
from dlrover_core.plugins.records import FailoverLevel
from dlrover_core.runs import RunPaths

#: the status of a job whose checkpoint already reached ``config.max_steps``: it trained
#: nothing (``dlrover submit`` exits 4; ``--fresh`` starts over)
ALREADY_COMPLETE = "already_complete"


class JobController:
    """Runs one job from ``PENDING`` to a terminal state (see the module doc).

    Args:
        spec: the validated job spec. job_dir: where events, metrics, checkpoints,
            the JobContext and ``summary.json`` go. pm: the plugin manager.
        run_id: this run of the job (the master's actor id).
        run: the run's number in the job directory (:mod:`dlrover_core.runs`).
    """

    def __init__(self, spec: DictConfig, job_dir: str, pm: Any, run_id: str = "",
                 run: int = 0) -> None:
        os.makedirs(job_dir, exist_ok=True)
        context = JobContext(os.path.join(job_dir, "context.sqlite"))
        self.scope = s = JobScope(
            spec=spec, job_dir=job_dir, graph=ComputationGraph.from_spec(spec), pm=pm,
            events=EventLog(RunPaths(job_dir, run, job_dir).events), context=context,
            instances=InstanceTable(context), failover=FailoverCoordinator(spec.failover, pm),
            run_id=run_id, run=run)
        self.monitor = Monitor(s)
        self.launcher = Launcher(s, self.monitor)
        self.standby = StandbyPool(s, self.launcher)
        self.recovery = RecoveryExecutor(s, self.launcher, self.monitor, self.standby)
        self.elastic = ElasticManager(s, self.launcher, self.standby)
        self.progress = ProgressRecorder(s)
        self.shards = ShardRegistry()
        self.node_check = NodeCheck(s, self.launcher)  # node health (docs/node-health.md)
        self.stragglers = self.progress.stragglers = StragglerDetector(s)
        self.tensorboard = attach_tensorboard(spec, job_dir, s.events, self.progress.metrics_log)
        self.health = HealthWatch(pm, s.name, spec, s.emit)  # the plugins' job_health checks
        self.state = JobState.PENDING
        self.error = ""
        self.summary: dict | None = None
        self.ended_at: float | None = None
        self.done = threading.Event()
        self._failures: collections.deque[Detection] = collections.deque()
        self._open: OpenRecovery | None = None
        self._attempt_bump = 0
        self._start_failed = False  # the failure being recovered broke a start-up
        self._handlers: dict[JobState, Callable[[], JobState | None]] = {
            JobState.PENDING: self._pending, JobState.PLACING: self._placing,
            JobState.STARTING: self._starting, JobState.RUNNING: self._running,
            JobState.RECOVERING: self._recovering}

    # ================================================================== the loop
    def run(self, reattaching: bool = False) -> None:
        """Drive the job to its end (blocking; the JobMaster runs it in a thread)."""
        status, error = JobState.FAILED, ""
        self.health.start()
        try:
            if reattaching:
                self._reattach()
            while not self.state.terminal:
                nxt = self._handlers[self.state]()
                if nxt is not None and nxt != self.state:
                    if nxt.terminal:
                        status = nxt
                        break
                    self._set_state(nxt)
                    if nxt == JobState.RUNNING and self._open is not None:
                        self.recovery.finish(self._open)
                        self._open = None
        except JobStopped:
            status = JobState.STOPPED
        except JobFailed as exc:
            error = str(exc)
        except PlacementError as exc:
            error = f"placement failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - a master bug still ends the job cleanly
            error = "internal error in the JobMaster: " + "".join(traceback.format_exception(exc))
        self._finish(status, error)

    def _set_state(self, new: JobState) -> None:
        """The one way the job's state changes: check the transition (raises
        ``IllegalTransitionError``), persist it, emit ``job_state_changed``."""
        s = self.scope
        with s.lock:
            check_transition(self.state, new)
            old, self.state = self.state, new
        s.context.set("state", new.value)
        s.emit("job_state_changed", previous=old.value, state=new.value)

    def stop(self) -> None:
        self.scope.stop_event.set()

    # ================================================================== states
    def _pending(self) -> JobState:
        s = self.scope
        s.emit("job_started", job=s.name, run=s.run, roles={
            r.name: {"total": r.total, "per_node": r.per_node, "backend": r.backend}
            for r in s.graph.roles.values()}, driver=s.graph.driver,
            master_node_id=ray.get_runtime_context().get_node_id())
        s.context.set("spec", OmegaConf.to_container(s.spec))
        s.check_stop()
        return JobState.PLACING

    def _placing(self) -> JobState:
        self.standby.forget_slots()  # their placement groups are about to be made again
        self.node_check.place()  # takes back nodes a check excluded if the job needs them
        self.node_check.after_placement()  # may exclude nodes and place again
        return JobState.STARTING

    def _starting(self) -> JobState:
        try:
            self.launcher.start_everything(self._attempt_bump)
            self.standby.ensure()
        except InstanceFailure as f:
            self._failures.append(self.monitor.diagnose(f.inst, f.exc))
            self._start_failed = True
            return JobState.RECOVERING
        return JobState.RUNNING

    def _running(self) -> JobState | None:
        s = self.scope
        s.check_stop()
        if self._failures:
            return JobState.RECOVERING
        if self.monitor.finished():
            return JobState.SUCCEEDED
        if not self.monitor.pending:
            raise JobFailed("nothing is running but the job did not finish (internal error)")
        self.progress.flush_due()
        self.standby.check()
        if self.elastic.ranges:
            try:
                self.elastic.check_grow()
            except InstanceFailure as f:
                self._failures.append(self.monitor.diagnose(f.inst, f.exc))
                return JobState.RECOVERING
        found = self.monitor.poll() or self.stragglers.check()
        if found is None:
            return None
        self._failures.append(found)
        return JobState.RECOVERING

    def _recovering(self) -> JobState | None:
        s = self.scope
        s.check_stop()
        if not self._failures:
            return JobState.RUNNING
        found = self._failures.popleft()
        if not s.instances.is_current(found.inst):
            return None  # replaced by the recovery of an earlier failure
        action = self._decide(found)
        self._open = self.recovery.begin(action, found.failure)
        if self.elastic.handles(found.failure) and not self._start_failed:
            # a lost node of an elastic role: that role alone restarts, at the size the
            # nodes left can hold once the replacement wait is over (master/elastic.py)
            try:
                self._open.phases = self.elastic.shrink(found.failure)
            except InstanceFailure as f:
                self._failures.appendleft(self.monitor.diagnose(f.inst, f.exc))
                return None
            return JobState.RUNNING
        if action.level in (FailoverLevel.NODE, FailoverLevel.JOB) or self._start_failed:
            # a start-up that failed part-way is started again as a whole (the other
            # roles and the driver may not be set up yet), whatever the level
            self._start_failed = False
            self.recovery.tear_down(self._open)
            self._attempt_bump = 1
            return JobState.PLACING if action.level == FailoverLevel.NODE else JobState.STARTING
        try:
            self.recovery.restart_in_place(self._open)
        except InstanceFailure as f:
            self._failures.appendleft(self.monitor.diagnose(f.inst, f.exc))
            return None
        return JobState.RUNNING

    def _decide(self, found: Detection) -> RecoveryAction:
        """Record the failure, classify it, pick the action; raise ``JobFailed`` when
        it is fatal."""
        s = self.scope
        drv = s.instances.driver
        failure = what_was_running(found.failure, found.inst.state == InstanceState.RUNNING,
                                   s.graph, drv.last_step if drv is not None else -1)
        s.instances.set_state(found.inst, InstanceState.FAILED)
        s.emit("instance_failed", role=failure.role, rank=failure.rank, kind=failure.kind,
               exc_type=failure.exc_type, message=failure.message[:2000], step=failure.step,
               node_id=failure.node_id, phase=failure.phase, attempt=failure.attempt)
        action = s.failover.decide(failure, s.graph)
        s.context.set("failover", s.failover.snapshot())
        s.emit("failure_classified", role=failure.role, rank=failure.rank,
               level=action.verdict.level, reason=action.verdict.reason,
               classifier=action.verdict.classifier, action=action.level)
        s.pm.workload_failed(s.name, failure, action.verdict, s.emit)
        if action.level == FailoverLevel.FATAL:
            detail = f"\n{failure.traceback}" if failure.traceback else ""
            raise JobFailed(f"{action.verdict.reason}. {failure.exc_type}: "
                            f"{failure.message}{detail}")
        return action

    # ================================================================== master restart
    def _reattach(self) -> None:
        """Ray restarted the master: take the persisted state back (a restore, not a
        transition), then go on where the old master was, or start over."""
        resized = restore_world_sizes(self.elastic)  # the sizes the roles ran at
        found = reattach(self.scope, self.launcher, self.monitor, self.standby)
        self.state = found.previous
        # after an elastic resize the groups are not the spec's (names, which rank is
        # in which): start over rather than re-attach to groups found by name
        if not found.intact or resized:  # or it died mid-transition: from the checkpoints
            self.launcher.stop_instances(self.scope.instances.all())
            self.launcher.remove_placement()
            if self.state != JobState.RECOVERING:
                self._set_state(JobState.RECOVERING)
            self._attempt_bump = 1
            self._set_state(JobState.PLACING)
            return
        for inst in found.lost:
            inst.state = InstanceState.RUNNING
            self._failures.append(self.monitor.diagnose(inst, ray.exceptions.ActorDiedError()))
        self.standby.ensure()

    # ================================================================== the end
    def _finish(self, status: JobState, error: str) -> None:
        s = self.scope
        self.health.stop()
        try:
            self.standby.drop()
            self.launcher.stop_instances(s.instances.all(), graceful=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        self.launcher.remove_placement()
        try:
            self.progress.flush_due(force=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        try:
            self._set_state(status)
        except Exception as exc:  # noqa: BLE001 - a bug, but the job must still end
            status, error = JobState.FAILED, (error or f"internal error in the JobMaster: {exc}")
            with s.lock:
                self.state = status
            s.context.set("state", status.value)
        with s.lock:
            self.error = error
            self.ended_at = time.time()
            wall = self.ended_at - s.started_at
            resumed = {role: dict(r) for role, r in s.resumed_from.items()}
            status_text = status.value
            if status == JobState.SUCCEEDED and self._already_complete():
                status_text = ALREADY_COMPLETE
                error = (f"nothing to train: the checkpoint of step "
                         f"{min(r['step'] for r in resumed.values())} already reaches "
                         f"config.max_steps={self._max_steps()}; raise config.max_steps, or "
                         "submit with --fresh to start over (the old checkpoints are kept)")
            self.summary = {
                "name": s.name, "run": s.run, "status": status_text, "error": error or None,
                "resumed_from": resumed or None,
                "metrics": dict(s.metrics), "steps": s.step + 1 if s.step >= 0 else 0,
                "last_step": s.step, "restarts": s.failover.restart_counts(),
                "wall_s": round(wall, 3), "started_at": s.started_at,
                "ended_at": self.ended_at, "checkpoint_steps": dict(s.checkpoint_steps),
                "failures": s.failover.failure_log(),
                "goodput": s.failover.goodput(wall, s.step_times),
            }
            if self.elastic.ranges:  # every size an elastic role ran at
                self.summary["world_sizes"] = list(self.elastic.history)
            if self.shards.services:  # per-sample ledger of the shard service
                ledger = self.shards.ledger(committed=dict(s.checkpoint_steps))
                self.summary.update({k: ledger[k] for k in (
                    "samples_lost", "samples_duplicated", "samples_reread_after_rollback",
                    "samples_leased_not_trained", "samples_not_trained")},
                    shards=ledger["roles"])
            if self.progress.tuning is not None:  # the config the job ended on
                self.summary["tuning"] = self.progress.tuning.summary()
            if self.health.current():  # a plugin's check still failing at the end
                self.summary["health"] = self.health.current()
        s.context.set("summary", self.summary)
        atomic_write_json(s.run_paths.summary, self.summary)  # in case a hook never returns
        try:
            s.pm.job_finished(s.name, self.summary, s.emit, s.spec)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        # the job ends when its plugins are done with it (the last flash checkpoint
        # persisted, say): the caller waits for that too, and job_finished comes after it.
        # A hook may also have added to the summary (a checkpoint step not on disk).
        with s.lock:
            self.ended_at = time.time()
            wall = self.ended_at - s.started_at
            self.summary.update(wall_s=round(wall, 3), ended_at=self.ended_at,
                                goodput=s.failover.goodput(wall, s.step_times))
        s.context.set("summary", self.summary)
        atomic_write_json(s.run_paths.summary, self.summary)
        s.emit("job_finished", status=status.value, error=(error or None),
               steps=self.summary["steps"], wall_s=self.summary["wall_s"])
        s.events.close()
        self.progress.close()
        self.done.set()

    def _max_steps(self) -> int | None:
        return _int_or_none(OmegaConf.select(self.scope.spec, "config.max_steps"))

    def _already_complete(self) -> bool:
        """Every role that resumed loaded a checkpoint at or past ``config.max_steps``
        (checkpoint ``N``: ``N`` steps done) and no step after it was reported."""
        s = self.scope
        max_steps, resumed = self._max_steps(), s.resumed_from
        if not resumed or max_steps is None:
            return False
        first = min(r["step"] for r in resumed.values())
        return first >= max_steps and s.step < first

    # ================================================================== views
    def status(self) -> dict:
        """What ``JobMaster.status()`` returns (see there)."""
        s = self.scope
        with s.lock:
            return {
                "name": s.name, "run": s.run, "job_dir": s.job_dir, "state": self.state.value,
                "step": s.step, "started_at": s.started_at,
                "resumed_from": {role: dict(r) for role, r in s.resumed_from.items()},
                "total_steps": _int_or_none(OmegaConf.select(s.spec, "config.max_steps")),
                "metrics": dict(s.metrics), "restarts": s.failover.restart_counts(),
                "elapsed_s": round((self.ended_at or time.time()) - s.started_at, 3),
                "error": self.error, "summary": self.summary if self.done.is_set() else None,
                "instances": {i.label: {"state": i.state.value, "attempt": i.attempt,
                                        "pid": i.pid, "node_id": i.node_id,
                                        "step": i.last_step}
                              for i in s.instances.all()},
                "standby": self.standby.warm(), "health": self.health.current(),
            }


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None
