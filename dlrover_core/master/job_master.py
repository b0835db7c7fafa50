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
import uuid
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
from dlrover_core.master.placement import ClusterResources, PlacementError, bundle_index
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
        try:
            self.run_id = ray.get_runtime_context().get_actor_id() or ""
        except Exception:  # noqa: BLE001 - not in an actor (unit use)
            self.run_id = ""
        self._last_node_check = 0.0
        self.standby: dict[str, tuple[Any, Any, str]] = {}  # role -> (handle, prepare ref, name)
        self._persist_every = 10
        if _was_reconstructed() and self.context.get("state") not in (None, "succeeded",
                                                                      "failed", "stopped"):
            self._thread = threading.Thread(target=self._main, args=(True,), name="job-master",
                                            daemon=True)
            self._thread.start()
        else:
            self.context.clear()
            self.context.set("started_at", self.started_at)

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
                "error": self.error, "summary": self.summary if self._done.is_set() else None,
                "instances": {i.label: {"state": i.state, "attempt": i.attempt, "pid": i.pid,
                                        "node_id": i.node_id, "step": i.last_step}
                              for i in self._all_instances()},
                "standby": {role: bool(ray.wait([ref], timeout=0)[0])
                            for role, (_, ref, _) in list(self.standby.items())},
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
    @ray.method(concurrency_group="report")
    def report(self, role: str, rank: int, step: int, metrics: dict, ts: float) -> None:
        """A step report from a worker (one at a time, in each sender's order)."""
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
            self.context.set("progress", {"step": self.step, "metrics": self.metrics})
            if step % self._persist_every == 0:
                self.context.set("step_times", self.step_times)
        self.pm.step_reported(self.name, role, rank, step, metrics)

    @ray.method(concurrency_group="report")
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

    def _set_state(self, new: JobState) -> None:
        """Enter or leave RECOVERING (allowed from any live state)."""
        with self._lock:
            self.state = new
        self.context.set("state", new.value)

    def _main(self, reattach: bool = False) -> None:
        status, error = JobState.FAILED, ""
        try:
            if reattach:
                self._reattach()
            else:
                self.events.emit("job_started", job=self.name, roles={
                    r.name: {"total": r.total, "per_node": r.per_node, "backend": r.backend}
                    for r in self.graph.roles.values()}, driver=self.graph.driver,
                    master_node_id=ray.get_runtime_context().get_node_id())
                self.context.set("spec", OmegaConf.to_container(self.spec))
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
    def _pg_name(self, group_name: str) -> str:
        return f"dlrover-{self.name}-{group_name}"

    def _place(self) -> None:
        policy = self.pm.get_placement_policy(self.spec.placement)
        cluster = ClusterResources.from_ray(exclude=self.failover.bad_nodes)
        self.plan = policy.plan(self.graph, cluster)
        alive_bad = sorted(self.failover.bad_nodes & {n.node_id for n in
                                                      ClusterResources.from_ray().nodes})
        self.pgs = []
        for g in self.plan.groups:
            kwargs: dict[str, Any] = {}
            if alive_bad:  # keep bad (but alive) nodes out: Ray's default node-id label
                kwargs["bundle_label_selector"] = [
                    {"ray.io/node-id": f"!in({','.join(alive_bad)})"}] * len(g.bundles)
            self.pgs.append(placement_group(g.bundles, strategy=g.strategy,
                                            name=self._pg_name(g.name), lifetime="detached",
                                            **kwargs))
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
            job_dir=self.job_dir, attempt=attempt, run_id=self.run_id)

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
            # detached: a restarted master must find its workers alive (owned actors would
            # die with their owner); the master kills them itself when the job ends
            "lifetime": "detached",
        }
        if slot.resources.get("memory"):
            opts["memory"] = slot.resources["memory"]
        env = dict(r.env)
        if env:
            opts["runtime_env"] = {"env_vars": env}
        handle = remote_workload_host().options(**opts).remote(
            r.workload, self._worker_context(role, rank, attempt))
        return self._register(role, rank, handle, name, attempt)

    def _register(self, role: str, rank: int, handle: Any, name: str, attempt: int) -> Instance:
        """Make ``handle`` the (new generation of the) instance ``role``/``rank``."""
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

    def _setup_members(self, members: list[Instance], fresh: list[Instance]) -> None:
        """Rendezvous and ``setup()`` of some instances (all ranks of each role with a
        backend; fresh ones need their node info first). Survivors are set up again
        in place, in their running process."""
        t0 = time.time()
        if fresh:
            infos = self._get([(i, i.handle.node_info.remote()) for i in fresh])
            for inst, info in zip(fresh, infos):
                inst.node_id, inst.ip, inst.pid, inst.info = (info["node_id"], info["ip"],
                                                              info["pid"], info)
                self.context.update_instance(inst.role, inst.rank, node_id=inst.node_id,
                                             pid=inst.pid)
        setups = []
        for role in dict.fromkeys(i.role for i in members):
            group = sorted((i for i in members if i.role == role), key=lambda i: i.rank)
            addr, port = "", 0
            if self.graph.roles[role].backend:
                rank0 = self.instances[(role, 0)]
                addr, port = rank0.ip, self._get([(rank0, rank0.handle.free_port.remote())])[0]
            topo = _topology([self.instances[(role, k)]
                              for k in range(self.graph.roles[role].total)])
            for inst in group:
                setups.append((inst, inst.handle.setup.remote(addr, port, inst.attempt,
                                                              *topo[inst.rank])))
        t_started = time.time()
        results = self._get(setups)
        self._setup_phases = {"actors_started_s": round(t_started - t0, 3),
                              "setup_s": round(time.time() - t_started, 3)}
        for key in ("import_s", "process_group_s", "user_setup_s"):  # slowest rank's
            self._setup_phases[key] = max((r.get("timings", {}).get(key, 0.0)
                                           for r in results), default=0.0)
        for (inst, _), res in zip(setups, results):
            inst.state = "running"
            inst.last_report_ts = time.time()
            self.invocations.setdefault(inst.role, res.get("invocations", {}))
            self.context.update_instance(inst.role, inst.rank, state="running",
                                         attempt=inst.attempt)
            self.events.emit("instance_started", role=inst.role, rank=inst.rank, pid=inst.pid,
                             node_id=inst.node_id, attempt=inst.attempt,
                             in_place=inst not in fresh,
                             placement_group_id=inst.info.get("placement_group_id"),
                             bundle_index=bundle_index(inst.info.get("assigned_resources", {})))
        for inst, _ in setups:
            self._launch(inst)

    def _launch(self, inst: Instance) -> None:
        """Start the instance's work: ``run()`` (SPMD) or a liveness watch (MPMD)."""
        if self.graph.driver:
            self._track(inst.handle.wait_stopped.remote(), "watch", inst)
        else:
            self._track(inst.handle.run.remote(), "run", inst)

    def _start_roles(self, roles: list[str], attempts: dict[tuple[str, int], int]) -> None:
        """Create, rendezvous and set up every instance of ``roles`` (in parallel)."""
        created = [self._create_instance(role, rank, attempts.get((role, rank), 0))
                   for role in roles for rank in range(self.graph.roles[role].total)]
        self._setup_members(created, created)

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
            name=name, namespace=MASTER_NAMESPACE, num_cpus=0, max_restarts=0,
            lifetime="detached").remote(
            self.graph.driver, tctx)
        inst = Instance(DRIVER, 0, handle, name, attempt=attempt, state="starting",
                        generation=(self.driver.generation + 1) if self.driver else 0)
        self.driver = inst
        self.context.set("driver", {"actor_name": name, "attempt": attempt})
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
        self._ensure_standbys()

    # ================================================================== standbys
    def _ensure_standbys(self) -> None:
        """One warm spare per role with a process group (``failover.standby``), on the
        node of the role's rank 0, holding no resources until it is promoted."""
        if not self.spec.failover.standby:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for role, r in self.graph.roles.items():
            if not r.backend or role in self.standby:
                continue
            rank0 = self.instances.get((role, 0))
            if rank0 is None or not rank0.node_id:
                continue
            # unique across master restarts: an earlier master's standby may still hold
            # an older name until _reattach kills it
            name = f"dlrover-{self.name}-{role}-standby-{uuid.uuid4().hex[:8]}"
            env = {**dict(r.env), "OMP_NUM_THREADS": str(max(1, int(r.resources.cpu)))}
            handle = remote_workload_host().options(
                name=name, namespace=MASTER_NAMESPACE, num_cpus=0, max_restarts=0,
                lifetime="detached", runtime_env={"env_vars": env},
                scheduling_strategy=NodeAffinitySchedulingStrategy(rank0.node_id, soft=True),
            ).remote(r.workload, self._worker_context(role, 0, 0))
            self.standby[role] = (handle, handle.prepare.remote(), name)
        self.context.set("standbys", [name for _, _, name in self.standby.values()])

    def _take_standby(self, role: str, rank: int, attempt: int) -> Instance | None:
        """Promote the role's standby to ``rank`` if it is warm and alive."""
        entry = self.standby.pop(role, None)
        self.context.set("standbys", [name for _, _, name in self.standby.values()])
        if entry is None:
            self.events.emit("standby_unusable", role=role, reason="none")
            return None
        handle, prepared, name = entry
        try:
            ray.get(prepared, timeout=0.5)
            ray.get(handle.assign.remote(self._worker_context(role, rank, attempt)), timeout=5)
        except Exception as exc:  # noqa: BLE001 - not warm yet, or dead: start a fresh one
            self.events.emit("standby_unusable", role=role, actor=name,
                             reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._kill_actor(handle)
            return None
        return self._register(role, rank, handle, name, attempt)

    def _drop_standbys(self) -> None:
        for handle, _, _ in self.standby.values():
            self._kill_actor(handle)
        self.standby.clear()
        self.context.set("standbys", [])

    @staticmethod
    def _kill_actor(handle: Any) -> None:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001
            pass

    def _track(self, ref: Any, kind: str, inst: Instance) -> None:
        self.pending[ref] = (kind, inst.key, inst.generation)

    def _untrack(self, insts: list[Instance]) -> None:
        keys = {(i.key, i.generation) for i in insts}
        for ref in [r for r, (_, k, g) in self.pending.items() if (k, g) in keys]:
            del self.pending[ref]

    # ================================================================== stopping actors
    def _kill(self, insts: list[Instance], graceful: bool = False) -> None:
        self._untrack(insts)
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
                    out = ray.get(ref)
                    if kind == "run_wait" and not out["ok"]:
                        raise out["error"]
                except Exception as exc:  # noqa: BLE001
                    self._handle_failure(inst, exc)
                    break  # pending changed
                if kind in ("run", "run_wait"):
                    self._instance_succeeded(inst)
            self._check_nodes()
            if hang_s > 0:
                self._check_hang(hang_s)

    def _instance_succeeded(self, inst: Instance) -> None:
        inst.state = "succeeded"
        self.context.update_instance(inst.role, inst.rank, state="succeeded")
        self.events.emit("instance_finished", role=inst.role, rank=inst.rank,
                         step=inst.last_step)
        if inst.role != DRIVER:
            self.pm.workload_stopped(self.name, inst.role, inst.rank, "succeeded")

    def _finished(self) -> bool:
        if self.graph.driver:
            return self.driver is not None and self.driver.state == "succeeded"
        return bool(self.instances) and all(i.state == "succeeded"
                                            for i in self.instances.values())

    def _check_nodes(self) -> None:
        """A node that left the cluster is a ``node_lost`` failure of its instances."""
        now = time.time()
        if now - self._last_node_check < 1.0:
            return
        self._last_node_check = now
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for inst in self._all_instances():
            if inst.state == "running" and inst.node_id and inst.node_id not in alive:
                self._handle_failure(inst, None, Failure(
                    "node_lost", inst.role, inst.rank, inst.node_id, "NodeLost",
                    f"node {inst.node_id[:12]} left the Ray cluster", "", "run",
                    inst.last_step, inst.attempt))
                return

    def _check_hang(self, hang_s: float) -> None:
        now = time.time()
        for inst in list(self.instances.values()):
            if inst.state != "running" or self.graph.driver:
                continue
            since = max(inst.last_report_ts, self.failover.last_recovery_end, self.started_at)
            if now - since > hang_s:
                self._handle_failure(inst, None, Failure(
                    "hang", inst.role, inst.rank, inst.node_id, "Hang",
                    f"no step report for {now - since:.1f} s (hang_timeout_s={hang_s:g})",
                    "", "run", inst.last_step, inst.attempt))
                return

    # ================================================================== failures
    def _node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())

    def _handle_failure(self, inst: Instance, exc: BaseException | None,
                        failure: Failure | None = None) -> None:
        while True:
            if failure is None:
                failure = failure_from_exception(inst, exc)  # type: ignore[arg-type]
                if failure.kind == "actor_died" and inst.node_id and \
                        not self._node_alive(inst.node_id):
                    failure = Failure("node_lost", failure.role, failure.rank, failure.node_id,
                                      "NodeLost", f"node {inst.node_id[:12]} left the cluster: "
                                      f"{failure.message}", "", failure.phase, failure.step,
                                      failure.attempt)
            if failure.role == DRIVER and failure.kind != "node_lost":
                dead = self._dead_instances()
                if dead:  # the driver failed because a role instance died: recover that
                    inst, failure = dead[0], None
                    exc = ray.exceptions.ActorDiedError()
                    continue
            inst.state = "failed"
            self.context.update_instance(inst.role, inst.rank, state="failed")
            self.events.emit("instance_failed", role=failure.role, rank=failure.rank,
                             kind=failure.kind, exc_type=failure.exc_type,
                             message=failure.message[:2000], step=failure.step,
                             node_id=failure.node_id, phase=failure.phase,
                             attempt=failure.attempt)
            action = self.failover.decide(failure, self.graph)
            self.context.set("failover", self.failover.snapshot())
            self.events.emit("failure_classified", role=failure.role, rank=failure.rank,
                             level=action.verdict.level, reason=action.verdict.reason,
                             classifier=action.verdict.classifier, action=action.level)
            self.pm.workload_failed(self.name, failure, action.verdict, self.events.emit)
            if action.level == "fatal":
                detail = f"\n{failure.traceback}" if failure.traceback else ""
                raise JobFailed(f"{action.verdict.reason}. {failure.exc_type}: "
                                f"{failure.message}{detail}")
            try:
                self._recover(action, failure)
                return
            except InstanceFailure as f:
                inst, exc, failure = f.inst, f.exc, None

    def _dead_instances(self, timeout: float = 2.0) -> list[Instance]:
        """Role instances that do not answer a ping (dead actors)."""
        live = [i for i in self.instances.values() if i.state == "running"]
        probes = {i.handle.ping.remote(): i for i in live}
        if not probes:
            return []
        ready, not_ready = ray.wait(list(probes), num_returns=len(probes), timeout=timeout)
        dead = [probes[r] for r in not_ready]
        for r in ready:
            try:
                ray.get(r)
            except Exception:  # noqa: BLE001
                dead.append(probes[r])
        return sorted(dead, key=lambda i: (i.role, i.rank))

    def _recover(self, action: RecoveryAction, failure: Failure) -> None:
        t0 = time.time()
        self._set_state(JobState.RECOVERING)
        self.events.emit("recovery_started", level=action.level, roles=action.roles,
                         role=failure.role, rank=failure.rank)
        step_at_failure = self.step
        self._phases = {}
        if action.level in ("node", "job"):
            self._drop_standbys()
        if action.level == "node":
            self._kill(self._all_instances())
            self._remove_placement()
            self._place()
            self._start_everything(attempt_bump=1)
        elif action.level == "job":
            self._kill(self._all_instances())
            self._start_everything(attempt_bump=1)
        elif failure.role == DRIVER:
            self._kill([self.driver])
            self._start_driver(self.driver.attempt + 1)
        else:
            for role in action.roles:
                ranks = [failure.rank] if action.level == "process" else \
                    list(range(self.graph.roles[role].total))
                self._restart_role(role, ranks)
            if self.graph.driver:  # it held handles of the replaced actors
                self._kill([self.driver])
                self._start_driver(self.driver.attempt + 1)
        self.failover.recovered(action)
        self.context.set("failover", self.failover.snapshot())
        self._set_state(JobState.RUNNING)
        resumed = {r: s for r, s in self.checkpoint_steps.items()}
        lost = None
        if failure.role in resumed and step_at_failure >= 0:
            lost = max(0, step_at_failure + 1 - resumed[failure.role])
        self.events.emit("recovery_finished", level=action.level,
                         seconds=round(time.time() - t0, 3), step_at_failure=step_at_failure,
                         resumed_from_checkpoint=resumed, steps_lost=lost, phases=self._phases)

    def _restart_role(self, role: str, failed_ranks: list[int]) -> None:
        """Replace the failed ranks of ``role``. A role with a process group re-forms
        it: survivors whose processes are intact leave their failed run and are set up
        again in place (new rendezvous, checkpoint reload) instead of being killed,
        which saves a process start and the imports; stuck or dead ones are replaced."""
        r = self.graph.roles[role]
        members = [self.instances[(role, k)] for k in range(r.total)]
        if r.backend and not self.spec.failover.in_place:
            failed_ranks = list(range(r.total))
        failed = [m for m in members if m.rank in failed_ranks]
        others = [m for m in members if m.rank not in failed_ranks]
        t0 = time.time()
        self._kill(failed)  # survivors blocked in a collective with them now fail fast
        survivors: list[Instance] = []
        if r.backend and others:
            self._untrack(others)
            grace = float(self.spec.failover.survivor_grace_s)
            probes = {m.handle.wait_run.remote(grace): m for m in others}
            ready, not_ready = ray.wait(list(probes), num_returns=len(probes),
                                        timeout=grace + 5)
            for ref in ready:
                m = probes[ref]
                try:
                    done = ray.get(ref)["done"]
                except Exception:  # noqa: BLE001 - dead too
                    done = False
                (survivors if done else failed).append(m)
            failed += [probes[ref] for ref in not_ready]
            self._kill([m for m in failed if m in others])
        t_survivors = time.time()
        fresh = []
        for m in sorted(failed, key=lambda i: i.rank):
            inst = self._take_standby(role, m.rank, m.attempt + 1)
            fresh.append(inst or self._create_instance(role, m.rank, m.attempt + 1))
        for m in survivors:
            m.attempt += 1
            m.generation += 1
        if r.backend:
            self._setup_members(sorted(fresh + survivors, key=lambda i: i.rank), fresh)
        else:
            self._setup_members(fresh, fresh)
        self._ensure_standbys()
        self._phases = {"survivors_s": round(t_survivors - t0, 3),
                        "standby_used": any("standby" in i.actor_name for i in fresh),
                        "replace_and_setup_s": round(time.time() - t_survivors, 3),
                        **getattr(self, "_setup_phases", {})}

    # ================================================================== master restart
    def _reattach(self) -> None:
        """After the master actor restarted: reload the context and re-attach to the
        instances that are still alive; what died meanwhile is recovered as usual."""
        t0 = time.time()
        ctx = self.context
        prev = ctx.get("state")
        self.started_at = ctx.get("started_at", self.started_at)
        progress = ctx.get("progress") or {}
        self.step = progress.get("step", -1)
        self.metrics = progress.get("metrics", {})
        self.step_times = {int(k): v for k, v in (ctx.get("step_times") or {}).items()}
        self.checkpoint_steps = ctx.get("checkpoint_steps") or {}
        self.failover.restore(ctx.get("failover") or {})
        self.state = JobState(prev)
        policy = self.pm.get_placement_policy(self.spec.placement)
        self.plan = policy.plan(self.graph, ClusterResources.from_ray(
            exclude=self.failover.bad_nodes))
        self.pgs = []
        for g in self.plan.groups:
            try:
                self.pgs.append(ray.util.get_placement_group(self._pg_name(g.name)))
            except ValueError:
                self.pgs = []
                break
        records = {(r.role, r.rank): r for r in ctx.instances()}
        attached, lost = [], []
        for (role, rank), rec in records.items():
            inst = Instance(role, rank, None, rec.actor_name, rec.node_id, pid=rec.pid,
                            attempt=rec.attempt, state=rec.state, last_step=rec.last_step)
            try:
                inst.handle = ray.get_actor(rec.actor_name, namespace=MASTER_NAMESPACE)
            except ValueError:
                inst.handle = None
            self.instances[(role, rank)] = inst
        drv = ctx.get("driver")
        if self.graph.driver and drv:
            self.driver = Instance(DRIVER, 0, None, drv["actor_name"], attempt=drv["attempt"],
                                   state="running")
            try:
                self.driver.handle = ray.get_actor(drv["actor_name"],
                                                   namespace=MASTER_NAMESPACE)
            except ValueError:
                pass
        self.events.emit("master_restarted", previous_state=prev,
                         instances=len(self.instances))
        for name in ctx.get("standbys") or []:  # the old master's spares: start afresh
            try:
                self._kill_actor(ray.get_actor(name, namespace=MASTER_NAMESPACE))
            except ValueError:
                pass
        ctx.set("standbys", [])
        if prev != JobState.RUNNING.value or len(self.pgs) != len(self.plan.groups) or \
                len(records) != sum(r.total for r in self.graph.roles.values()):
            # it died mid-transition: start the job over from its checkpoints
            self._kill(self._all_instances())
            self._remove_placement()
            self.state = JobState.RECOVERING
            self._place()
            self._guarded(self._start_everything, 1)
            self._set_state(JobState.RUNNING)
            return
        for inst in self._all_instances():
            if inst.state == "succeeded":
                attached.append(inst)
                continue
            alive = False
            if inst.handle is not None:
                try:
                    info = ray.get(inst.handle.node_info.remote(), timeout=10)
                    inst.node_id, inst.ip, inst.pid = info["node_id"], info["ip"], info["pid"]
                    alive = True
                except Exception:  # noqa: BLE001
                    alive = False
            if alive:
                inst.state = "running"
                inst.last_report_ts = time.time()
                if inst.role != DRIVER:  # reports sent while the master was down are lost
                    prog = ray.get(inst.handle.progress.remote(), timeout=10)
                    if inst.rank == 0 and prog["step"] > self.step:
                        self.step = prog["step"]
                        self.metrics.update(prog["metrics"])
                    inst.last_step = max(inst.last_step, prog["step"])
                if inst.role != DRIVER and self.graph.driver:
                    self._track(inst.handle.wait_stopped.remote(), "watch", inst)
                else:
                    self._track(inst.handle.wait_run.remote(), "run_wait", inst)
                attached.append(inst)
            else:
                lost.append(inst)
        self.events.emit("master_reattached", attached=[i.label for i in attached],
                         lost=[i.label for i in lost], seconds=round(time.time() - t0, 3))
        for inst in lost:
            current = self.driver if inst.role == DRIVER else self.instances.get(inst.key)
            if current is not inst:
                continue  # already replaced by the recovery of an earlier one
            inst.state = "running"
            self._handle_failure(inst, ray.exceptions.ActorDiedError())
        self._ensure_standbys()

    # ================================================================== the end
    def _finish(self, status: JobState, error: str) -> None:
        try:
            self._drop_standbys()
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
        try:
            self.pm.job_finished(self.name, self.summary, self.events.emit)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        self.events.emit("job_finished", status=status.value, error=(error or None),
                         steps=self.summary["steps"], wall_s=self.summary["wall_s"])
        self.events.close()
        self.metrics_log.close()
        self._done.set()


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


def _was_reconstructed() -> bool:
    """True when Ray restarted this (master) actor after it died."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - outside an actor
        return False


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None
