"""The JobMaster: one named, detached Ray actor per job.

It is an explicit state machine (``JobState``): PLACING (placement groups from the
placement policy) -> STARTING (one ``WorkloadHost`` actor per role rank,
rendezvous, ``setup()``) -> RUNNING (SPMD ``run()`` loops, or the driver's
``fit()``) -> SUCCEEDED / FAILED / STOPPED, with RECOVERING in between when
something fails. Failures go through the plugins' ``dlrover_classify_failure``;
what happens for each level is decided by the ``FailoverCoordinator``.

Public methods are called by the client (``start``, ``status``, ``stop``,
``wait``) and by workers (``report``, ``checkpoint_saved``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlrover_core.checkpoint.saver import atomic_write_json
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.master.context import InstanceRecord, JobContext
from dlrover_core.master.events import EventLog
from dlrover_core.master.failover import FailoverCoordinator, JobFailed, RecoveryAction
from dlrover_core.master.placement import ClusterResources, PlacementError
from dlrover_core.master.states import TRANSITIONS, JobState
from dlrover_core.plugins.manager import get_plugin_manager
from dlrover_core.plugins.records import Failure
from dlrover_core.runtime.context import MASTER_NAMESPACE, WorkerContext
from dlrover_core.runtime.errors import WorkloadError
from dlrover_core.runtime.host import remote_driver_host, remote_workload_host
from dlrover_core.runtime.role_group import RoleGroup
from dlrover_core.runtime.trainer import TrainerContext

log = logging.getLogger(__name__)

DRIVER = "driver"
POLL_S = 0.25
PG_READY_TIMEOUT_S = 120.0


class _Stop(Exception):
    pass


class InstanceFailure(Exception):
    """Raised inside the master when an instance fails while being started."""

    def __init__(self, inst: Instance, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.inst = inst
        self.exc = exc


@dataclass
class Instance:
    """A role rank (or the driver) as the master tracks it."""

    role: str
    rank: int
    handle: Any = None
    actor_name: str = ""
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    attempt: int = 0
    state: str = "pending"
    last_step: int = -1
    last_report_ts: float = 0.0
    generation: int = 0
    info: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return (self.role, self.rank)

    @property
    def label(self) -> str:
        return self.role if self.role == DRIVER else f"{self.role}-{self.rank}"


def failure_from_exception(inst: Instance, exc: BaseException) -> Failure:
    """Turn what ``ray.get`` raised into a ``Failure``."""
    cause = getattr(exc, "cause", None)
    werr = exc if isinstance(exc, WorkloadError) else cause if isinstance(cause, WorkloadError) \
        else None
    if werr is not None:
        return Failure("user_error", inst.role, inst.rank, inst.node_id, werr.exc_type,
                       werr.message, werr.traceback, werr.phase, werr.step, inst.attempt)
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)):
        return Failure("actor_died", inst.role, inst.rank, inst.node_id,
                       type(exc).__name__, str(exc).strip().splitlines()[0][:500] if str(exc) else
                       "actor died", "", "run" if inst.last_step >= 0 else "setup",
                       inst.last_step, inst.attempt)
    return Failure("user_error", inst.role, inst.rank, inst.node_id, type(exc).__name__,
                   str(exc)[:500], "".join(traceback.format_exception(exc)),
                   "run" if inst.last_step >= 0 else "setup", inst.last_step, inst.attempt)


class JobMaster:
    """Runs one job. Create with :func:`dlrover_core.master.client.create_master`."""

    def __init__(self, spec: dict, job_dir: str) -> None:
        self.spec = OmegaConf.create(spec)
        self.name: str = self.spec.name
        self.job_dir = job_dir
        os.makedirs(job_dir, exist_ok=True)
        self.pm = get_plugin_manager()
        self.graph = ComputationGraph.from_spec(self.spec)
        self.events = EventLog(os.path.join(job_dir, "events.jsonl"))
        self.metrics_log = EventLog(os.path.join(job_dir, "metrics.jsonl"))
        self.context = JobContext(os.path.join(job_dir, "context.sqlite"))
        self.failover = FailoverCoordinator(self.spec.failover, self.pm)
        self.state = JobState.PENDING
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.instances: dict[tuple[str, int], Instance] = {}
        self.driver: Instance | None = None
        self.pgs: list[Any] = []
        self.plan: Any = None
        self.pending: dict[Any, tuple[str, tuple[str, int], int]] = {}
        self.invocations: dict[str, dict] = {}
        self.metrics: dict[str, float] = {}
        self.step = -1
        self.step_times: dict[int, float] = {}
        self.checkpoint_steps: dict[str, int] = {}
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.error = ""
        self.summary: dict | None = None
        self.total_steps = _int_or_none(OmegaConf.select(self.spec, "config.max_steps"))

    # ================================================================== client API
    def start(self) -> str:
        """Start the job in a background thread; returns the job name."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="job-master", daemon=True)
                self._thread.start()
        return self.name

    def status(self) -> dict:
        """``state``, ``step``, ``total_steps``, ``metrics``, ``restarts``, ``elapsed_s``,
        ``error`` and, when finished, ``summary``."""
        with self._lock:
            return {
                "name": self.name, "state": self.state.value, "step": self.step,
                "total_steps": self.total_steps, "metrics": dict(self.metrics),
                "restarts": self.failover.restart_counts(),
                "elapsed_s": round((self.ended_at or time.time()) - self.started_at, 3),
                "error": self.error, "summary": self.summary,
                "instances": {i.label: {"state": i.state, "attempt": i.attempt, "pid": i.pid,
                                        "node_id": i.node_id, "step": i.last_step}
                              for i in self._all_instances()},
            }

    def stop(self) -> None:
        """Ask the job to stop; it ends in state ``stopped``."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> dict | None:
        """Block until the job ends (or ``timeout`` s); returns the summary or ``None``."""
        self._done.wait(timeout)
        return self.summary

    def shutdown(self) -> None:
        """Exit the master actor (after the job ended)."""
        self._stop.set()
        self._done.wait(30)
        ray.actor.exit_actor()

    # ================================================================== worker API
    def report(self, role: str, rank: int, step: int, metrics: dict, ts: float) -> None:
        with self._lock:
            inst = self.driver if role == DRIVER else self.instances.get((role, rank))
            if inst is not None:
                inst.last_step = step
                inst.last_report_ts = time.time()
            if rank == 0:
                self.metrics.update(metrics)
                if step > self.step:
                    self.step = step
                    self.step_times.setdefault(step, ts)
        if rank == 0:
            self.metrics_log.emit("step", role=role, step=step, **metrics)
        self.pm.step_reported(self.name, role, rank, step, metrics)

    def checkpoint_saved(self, role: str, rank: int, step: int, seconds: float) -> None:
        if rank != 0:
            return
        with self._lock:
            self.checkpoint_steps[role] = step
            self.context.set("checkpoint_steps", self.checkpoint_steps)
        self.events.emit("checkpoint_saved", role=role, step=step, blocking_s=round(seconds, 4))

    # ================================================================== state machine
    def _transition(self, new: JobState) -> None:
        with self._lock:
            if new not in TRANSITIONS[self.state]:
                raise RuntimeError(f"illegal job transition {self.state.value} -> {new.value}")
            self.state = new
            self.context.set("state", new.value)

    def _main(self) -> None:
        self.events.emit("job_started", job=self.name, roles={
            r.name: {"total": r.total, "per_node": r.per_node, "backend": r.backend}
            for r in self.graph.roles.values()}, driver=self.graph.driver)
        self.context.set("spec", OmegaConf.to_container(self.spec))
        status, error = JobState.FAILED, ""
        try:
            self._check_stop()
            self._transition(JobState.PLACING)
            self._place()
            self._transition(JobState.STARTING)
            self._guarded(self._start_everything)
            self._transition(JobState.RUNNING)
            self._monitor()
            status = JobState.SUCCEEDED
        except _Stop:
            status = JobState.STOPPED
        except JobFailed as exc:
            error = str(exc)
        except PlacementError as exc:
            error = f"placement failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - a master bug still ends the job cleanly
            error = "internal error in the JobMaster: " + "".join(traceback.format_exception(exc))
        self._finish(status, error)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stop()

    def _guarded(self, fn: Any, *args: Any) -> None:
        """Run a start-up step; failures go through classification and recovery."""
        try:
            fn(*args)
        except InstanceFailure as f:
            self._handle_failure(f.inst, f.exc)

    # ================================================================== placement
    def _place(self) -> None:
        policy = self.pm.get_placement_policy(self.spec.placement)
        cluster = ClusterResources.from_ray(exclude=self.failover.bad_nodes)
        self.plan = policy.plan(self.graph, cluster)
        self.pgs = []
        for g in self.plan.groups:
            self.pgs.append(placement_group(g.bundles, strategy=g.strategy,
                                            name=f"dlrover-{self.name}-{g.name}"))
        deadline = time.time() + PG_READY_TIMEOUT_S
        for pg, g in zip(self.pgs, self.plan.groups):
            while True:
                self._check_stop()
                ready, _ = ray.wait([pg.ready()], timeout=1.0)
                if ready:
                    break
                if time.time() > deadline:
                    raise PlacementError(
                        f"placement group {g.name} ({g.bundles}, {g.strategy}) was not ready "
                        f"within {PG_READY_TIMEOUT_S:.0f} s: the cluster lacks free resources")
        self.events.emit("placement", policy=self.spec.placement, groups=self.plan.describe(),
                         excluded_nodes=sorted(self.failover.bad_nodes))
        self.context.set("placement", self.plan.describe())

    def _remove_placement(self) -> None:
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.pgs = []

    # ================================================================== starting
    def _worker_context(self, role: str, rank: int, attempt: int) -> WorkerContext:
        r = self.graph.roles[role]
        slot = self.plan.slots[(role, rank)]
        group = self.graph.group_of(role)
        config = OmegaConf.merge(self.spec.config, r.config or {})
        return WorkerContext(
            job=self.name, role=role, rank=rank, world_size=r.total,
            local_rank=slot.local_rank, local_world_size=slot.local_world_size,
            node_rank=slot.node_rank, backend=r.backend,
            collocation=",".join(group.roles) if len(group.roles) > 1 else "",
            config=OmegaConf.to_container(config, resolve=True),
            checkpoint=OmegaConf.to_container(self.spec.checkpoint),
            failover=OmegaConf.to_container(self.spec.failover),
            tuning=OmegaConf.to_container(self.spec.tuning),
            job_dir=self.job_dir, attempt=attempt)

    def _create_instance(self, role: str, rank: int, attempt: int) -> Instance:
        r = self.graph.roles[role]
        slot = self.plan.slots[(role, rank)]
        name = f"dlrover-{self.name}-{role}-{rank}-a{attempt}"
        opts: dict[str, Any] = {
            "name": name, "namespace": MASTER_NAMESPACE,
            "num_cpus": slot.resources.get("CPU", 0.0),
            "num_gpus": slot.resources.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pgs[slot.pg], placement_group_bundle_index=slot.bundle),
            "max_restarts": 0,
        }
        if slot.resources.get("memory"):
            opts["memory"] = slot.resources["memory"]
        env = dict(r.env)
        if env:
            opts["runtime_env"] = {"env_vars": env}
        handle = remote_workload_host().options(**opts).remote(
            r.workload, self._worker_context(role, rank, attempt))
        prev = self.instances.get((role, rank))
        inst = Instance(role, rank, handle, name, attempt=attempt, state="starting",
                        generation=(prev.generation + 1) if prev else 0)
        self.instances[(role, rank)] = inst
        self.context.put_instance(InstanceRecord(role, rank, name, state="starting",
                                                 attempt=attempt))
        return inst

    def _get(self, pairs: list[tuple[Instance, Any]], timeout: float | None = None) -> list:
        """``ray.get`` each ref; the first failure raises ``InstanceFailure``. Honors stop."""
        out: dict[int, Any] = {}
        waiting = {ref: i for i, (_, ref) in enumerate(pairs)}
        deadline = None if timeout is None else time.time() + timeout
        while waiting:
            self._check_stop()
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=POLL_S)
            for ref in ready:
                i = waiting.pop(ref)
                try:
                    out[i] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    raise InstanceFailure(pairs[i][0], exc) from None
            if deadline is not None and time.time() > deadline and waiting:
                inst = pairs[next(iter(waiting.values()))][0]
                raise InstanceFailure(inst, TimeoutError(
                    f"{inst.label} did not answer within {timeout} s during start-up"))
        return [out[i] for i in range(len(pairs))]

    def _start_roles(self, roles: list[str], attempts: dict[tuple[str, int], int]) -> None:
        """Create, rendezvous and set up every instance of ``roles`` (in parallel)."""
        created: list[Instance] = []
        for role in roles:
            for rank in range(self.graph.roles[role].total):
                created.append(self._create_instance(role, rank, attempts.get((role, rank), 0)))
        infos = self._get([(i, i.handle.node_info.remote()) for i in created])
        for inst, info in zip(created, infos):
            inst.node_id, inst.ip, inst.pid, inst.info = (info["node_id"], info["ip"],
                                                          info["pid"], info)
            self.context.update_instance(inst.role, inst.rank, node_id=inst.node_id, pid=inst.pid)
        setups = []
        for role in roles:
            members = [i for i in created if i.role == role]
            rank0 = members[0]
            port = self._get([(rank0, rank0.handle.free_port.remote())])[0]
            topo = _topology(members)
            for inst in members:
                setups.append((inst, inst.handle.setup.remote(
                    rank0.ip, port, inst.attempt, *topo[inst.rank])))
        results = self._get(setups)
        for (inst, _), res in zip(setups, results):
            inst.state = "running"
            self.invocations.setdefault(inst.role, res.get("invocations", {}))
            self.context.update_instance(inst.role, inst.rank, state="running")
            self.events.emit("instance_started", role=inst.role, rank=inst.rank, pid=inst.pid,
                             node_id=inst.node_id, attempt=inst.attempt,
                             placement_group_id=inst.info.get("placement_group_id"),
                             bundle_index=bundle_index(inst.info.get("assigned_resources", {})))
        for inst in created:
            if self.graph.driver:
                self._track(inst.handle.wait_stopped.remote(), "watch", inst)
            else:
                self._track(inst.handle.run.remote(), "run", inst)

    def _start_driver(self, attempt: int = 0) -> None:
        groups = {role: RoleGroup(role, [self.instances[(role, k)].handle
                                         for k in range(r.total)], self.invocations.get(role, {}))
                  for role, r in self.graph.roles.items()}
        tctx = TrainerContext(
            job=self.name, role_groups=groups,
            config=OmegaConf.to_container(self.spec.config, resolve=True),
            resources={role: {"cpu": r.resources.cpu, "gpu": r.resources.gpu}
                       for role, r in self.graph.roles.items()},
            job_dir=self.job_dir, attempt=attempt)
        name = f"dlrover-{self.name}-driver-a{attempt}"
        handle = remote_driver_host().options(
            name=name, namespace=MASTER_NAMESPACE, num_cpus=0, max_restarts=0).remote(
            self.graph.driver, tctx)
        inst = Instance(DRIVER, 0, handle, name, attempt=attempt, state="starting",
                        generation=(self.driver.generation + 1) if self.driver else 0)
        self.driver = inst
        info = self._get([(inst, handle.node_info.remote())])[0]
        inst.node_id, inst.ip, inst.pid = info["node_id"], info["ip"], info["pid"]
        self._get([(inst, handle.setup.remote())])
        inst.state = "running"
        self.events.emit("instance_started", role=DRIVER, rank=0, pid=inst.pid,
                         node_id=inst.node_id, attempt=attempt)
        self._track(handle.run.remote(), "run", inst)

    def _start_everything(self, attempt_bump: int = 0) -> None:
        attempts = {k: i.attempt + attempt_bump for k, i in self.instances.items()}
        self._start_roles(list(self.graph.order), attempts)
        if self.graph.driver:
            self._start_driver((self.driver.attempt + attempt_bump) if self.driver else 0)

    def _track(self, ref: Any, kind: str, inst: Instance) -> None:
        self.pending[ref] = (kind, inst.key, inst.generation)

    # ================================================================== stopping actors
    def _kill(self, insts: list[Instance], graceful: bool = False) -> None:
        keys = {(i.key, i.generation) for i in insts}
        for ref in [r for r, (_, k, g) in self.pending.items() if (k, g) in keys]:
            del self.pending[ref]
        if graceful:
            refs = [i.handle.shutdown.remote() for i in insts if i.handle is not None]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=10)
        for i in insts:
            if i.handle is not None:
                try:
                    ray.kill(i.handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            if i.state not in ("succeeded",):
                i.state = "stopped" if graceful else "killed"

    def _all_instances(self) -> list[Instance]:
        out = list(self.instances.values())
        if self.driver is not None:
            out.append(self.driver)
        return out

    # ================================================================== running
    def _monitor(self) -> None:
        hang_s = float(self.spec.failover.hang_timeout_s or 0)
        while True:
            self._check_stop()
            if self._finished():
                return
            if not self.pending:
                raise JobFailed("nothing is running but the job did not finish (internal error)")
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                entry = self.pending.pop(ref, None)
                if entry is None:
                    continue
                kind, key, gen = entry
                inst = self.driver if key[0] == DRIVER else self.instances.get(key)
                if inst is None or inst.generation != gen:
                    continue
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    self._handle_failure(inst, exc)
                    break  # pending changed
                if kind == "run":
                    inst.state = "succeeded"
                    self.context.update_instance(inst.role, inst.rank, state="succeeded")
                    self.events.emit("instance_finished", role=inst.role, rank=inst.rank,
                                     step=inst.last_step)
                    if inst.role != DRIVER:
                        self.pm.workload_stopped(self.name, inst.role, inst.rank, "succeeded")
            if hang_s > 0:
                self._check_hang(hang_s)

    def _finished(self) -> bool:
        if self.graph.driver:
            return self.driver is not None and self.driver.state == "succeeded"
        return bool(self.instances) and all(i.state == "succeeded"
                                            for i in self.instances.values())

    def _check_hang(self, hang_s: float) -> None:
        now = time.time()
        for inst in list(self.instances.values()):
            if inst.state != "running":
                continue
            since = max(inst.last_report_ts, self.failover.last_recovery_end, self.started_at)
            if now - since > hang_s:
                self._handle_failure(inst, None, Failure(
                    "hang", inst.role, inst.rank, inst.node_id, "Hang",
                    f"no step report for {now - since:.1f} s (hang_timeout_s={hang_s:g})",
                    "", "run", inst.last_step, inst.attempt))
                return

    # ================================================================== failures
    def _handle_failure(self, inst: Instance, exc: BaseException | None,
                        failure: Failure | None = None) -> None:
        while True:
            if failure is None:
                failure = failure_from_exception(inst, exc)  # type: ignore[arg-type]
            inst.state = "failed"
            self.context.update_instance(inst.role, inst.rank, state="failed")
            self.events.emit("instance_failed", role=failure.role, rank=failure.rank,
                             kind=failure.kind, exc_type=failure.exc_type,
                             message=failure.message[:2000], step=failure.step,
                             node_id=failure.node_id, phase=failure.phase)
            action = self.failover.decide(failure, self.graph)
            self.events.emit("failure_classified", role=failure.role, rank=failure.rank,
                             level=action.verdict.level, reason=action.verdict.reason,
                             classifier=action.verdict.classifier, action=action.level)
            self.pm.workload_failed(self.name, failure, action.verdict)
            if action.level == "fatal":
                detail = f"\n{failure.traceback}" if failure.traceback else ""
                raise JobFailed(f"{action.verdict.reason}. {failure.exc_type}: "
                                f"{failure.message}{detail}")
            try:
                self._recover(action, failure)
                return
            except InstanceFailure as f:
                inst, exc, failure = f.inst, f.exc, None

    def _recover(self, action: RecoveryAction, failure: Failure) -> None:
        t0 = time.time()
        with self._lock:
            self.state = JobState.RECOVERING
        self.context.set("state", JobState.RECOVERING.value)
        self.events.emit("recovery_started", level=action.level, roles=action.roles,
                         role=failure.role, rank=failure.rank)
        redo_from = self.step
        if action.level == "node":
            self._kill(self._all_instances())
            self._remove_placement()
            self._place()
            self._start_everything(attempt_bump=1)
        elif action.level == "job" or (self.graph.driver and action.level in ("role", "process")
                                       and failure.role == DRIVER):
            self._kill(self._all_instances())
            self._start_everything(attempt_bump=1)
        else:
            roles = action.roles or [failure.role]
            insts = [i for i in self.instances.values() if i.role in roles]
            self._kill(insts)
            self._start_roles(roles, {i.key: i.attempt + 1 for i in insts})
        self.failover.recovered(action)
        with self._lock:
            self.state = JobState.RUNNING
        self.context.set("state", JobState.RUNNING.value)
        self.events.emit("recovery_finished", level=action.level, seconds=round(time.time() - t0, 3),
                         step_at_failure=redo_from,
                         resumed_from_checkpoint=dict(self.checkpoint_steps))

    # ================================================================== the end
    def _finish(self, status: JobState, error: str) -> None:
        try:
            self._kill(self._all_instances(), graceful=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        self._remove_placement()
        with self._lock:
            self.state = status
            self.error = error
            self.ended_at = time.time()
            wall = self.ended_at - self.started_at
            self.summary = {
                "name": self.name, "status": status.value, "error": error or None,
                "metrics": dict(self.metrics), "steps": self.step + 1 if self.step >= 0 else 0,
                "last_step": self.step, "restarts": self.failover.restart_counts(),
                "wall_s": round(wall, 3), "started_at": self.started_at,
                "ended_at": self.ended_at, "checkpoint_steps": dict(self.checkpoint_steps),
                "failures": self.failover.failure_log(),
                "goodput": self.failover.goodput(wall, self.step_times),
            }
        self.context.set("state", status.value)
        self.context.set("summary", self.summary)
        atomic_write_json(os.path.join(self.job_dir, "summary.json"), self.summary)
        self.events.emit("job_finished", status=status.value, error=(error or None),
                         steps=self.summary["steps"], wall_s=self.summary["wall_s"])
        self.events.close()
        self.metrics_log.close()
        try:
            self.pm.job_finished(self.name, self.summary)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        self._done.set()


def bundle_index(assigned: dict[str, float]) -> int | None:
    """The bundle index in Ray's assigned resource names (``CPU_group_<i>_<pg id>``)."""
    for name in assigned:
        parts = name.split("_group_")
        if len(parts) == 2:
            idx = parts[1].split("_", 1)[0]
            if idx.isdigit():
                return int(idx)
    return None


def _topology(members: list[Instance]) -> dict[int, tuple[int, int, int]]:
    """rank -> (local_rank, local_world_size, node_rank) from the actual nodes."""
    by_node: dict[str, list[Instance]] = {}
    for inst in sorted(members, key=lambda i: i.rank):
        by_node.setdefault(inst.node_id, []).append(inst)
    out = {}
    for node_rank, insts in enumerate(by_node.values()):
        for local, inst in enumerate(insts):
            out[inst.rank] = (local, len(insts), node_rank)
    return out


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None
