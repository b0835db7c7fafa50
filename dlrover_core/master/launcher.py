"""The launcher: placement groups, actor creation, rendezvous and ``setup()``.

It turns the placement policy's plan into Ray placement groups (:meth:`Launcher.place`),
creates one ``WorkloadHost`` actor per role rank in its bundle and a ``DriverHost`` for
the driver, gives each role with a process group a rendezvous address (rank 0's node,
a free port there), runs ``setup()`` everywhere in parallel and hands each started
instance to the monitor. It stops actors too (:meth:`Launcher.stop_instances`). It
never decides anything: failures come out as ``InstanceFailure``.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Callable

import ray
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlrover_core.master.instances import DRIVER, Instance, InstanceFailure, InstanceState
from dlrover_core.placement import ClusterResources, PlacementError, PlacementPlan, bundle_index
from dlrover_core.runtime.context import MASTER_NAMESPACE, WorkerContext
from dlrover_core.runtime.host import remote_driver_host, remote_workload_host
from dlrover_core.runtime.role_group import RoleGroup
from dlrover_core.runtime.trainer import TrainerContext

if TYPE_CHECKING:
    from dlrover_core.master.monitor import Monitor
    from dlrover_core.master.scope import JobScope

POLL_S = 0.25
PG_READY_TIMEOUT_S = 120.0


def kill_actor(handle: Any) -> None:
    """``ray.kill`` without restart; an actor that is already gone is fine."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001
        pass


def create_placement_groups(groups: list[tuple[str, Any]], exclude_nodes: list[str],
                            check_stop: Callable[[], None], made: list[Any],
                            what: str = "", timeout_s: float = PG_READY_TIMEOUT_S) -> list[Any]:
    """Create one detached placement group per ``(Ray name, plan group)`` and wait until
    each is ready: one at a time, the largest first (GPUs, then CPUs: first-fit
    decreasing), each ready before the next is made, so that a small group (a 1-CPU
    watcher) cannot take part of the node a larger one is waiting for (a node that
    joined a moment ago and is not yet schedulable). Bundles never land on
    ``exclude_nodes`` (node ids; Ray's ``ray.io/node-id`` label).

    Args:
        groups: ``(name, group)`` pairs; ``group`` has ``bundles``, ``strategy``, ``name``.
        exclude_nodes: node ids (hex) to keep out.
        check_stop: called while waiting; raises to stop.
        made: every group is appended to it as soon as it exists (so that the caller
            can remove them when this raises).
        what: words after the group's name in the error (e.g. `` of elastic role 'x'``).
        timeout_s: how long all of them may take to be ready, in s (default
            ``PG_READY_TIMEOUT_S``, 120).
    Returns:
        The placement groups, in the order of ``groups``.
    Raises:
        PlacementError: the groups were not all ready within ``timeout_s`` of the call
            (the groups made so far stay in ``made``: the caller removes them).
        whatever ``check_stop`` raises.
    """
    order = sorted(range(len(groups)), key=lambda i: tuple(
        -sum(b.get(k, 0.0) for b in groups[i][1].bundles) for k in ("GPU", "CPU")))
    out: dict[int, Any] = {}
    deadline = time.time() + timeout_s
    for i in order:
        name, g = groups[i]
        kwargs: dict[str, Any] = {}
        if exclude_nodes:
            kwargs["bundle_label_selector"] = [
                {"ray.io/node-id": f"!in({','.join(exclude_nodes)})"}] * len(g.bundles)
        pg = out[i] = placement_group(g.bundles, strategy=g.strategy, name=name,
                                      lifetime="detached", **kwargs)
        made.append(pg)
        while not ray.wait([pg.ready()], timeout=1.0)[0]:
            check_stop()
            if time.time() > deadline:
                raise PlacementError(
                    f"placement group {g.name} ({g.bundles}, {g.strategy}){what} was not "
                    f"ready within {timeout_s:g} s: the cluster lacks free "
                    "resources")
    return [out[i] for i in range(len(groups))]


def topology(members: list[Instance]) -> dict[int, tuple[int, int, int]]:
    """rank -> (local_rank, local_world_size, node_rank), from the nodes the members
    actually run on (nodes numbered in order of their lowest rank)."""
    by_node: dict[str, list[Instance]] = {}
    for inst in sorted(members, key=lambda i: i.rank):
        by_node.setdefault(inst.node_id, []).append(inst)
    out = {}
    for node_rank, insts in enumerate(by_node.values()):
        for local, inst in enumerate(insts):
            out[inst.rank] = (local, len(insts), node_rank)
    return out


class Launcher:
    """Places and starts the job's actors. ``phases`` holds the timings of the last
    :meth:`setup_members` (``actors_started_s``, ``setup_s`` and the slowest rank's
    ``import_s``/``process_group_s``/``user_setup_s``)."""

    def __init__(self, scope: JobScope, monitor: Monitor) -> None:
        self.scope = scope
        self.monitor = monitor
        self.plan: PlacementPlan | None = None
        self.pgs: list[Any] = []
        self.phases: dict[str, Any] = {}

    # ------------------------------------------------------------------ placement
    def pg_name(self, group_name: str) -> str:
        return f"dlrover-{self.scope.name}-{group_name}"

    def make_plan(self) -> PlacementPlan:
        """The placement policy's plan over the alive nodes that are not marked bad."""
        s = self.scope
        policy = s.pm.get_placement_policy(s.spec.placement)
        return policy.plan(s.graph, ClusterResources.from_ray(exclude=s.failover.bad_nodes))

    def place(self) -> None:
        """Create the placement groups and wait until they are ready (one at a time,
        the largest first: :func:`create_placement_groups`).

        Raises:
            PlacementError: the policy cannot place the graph, or a group was not ready
                within ``PG_READY_TIMEOUT_S`` (120 s).
            JobStopped: ``stop()`` was called while waiting.
        """
        s = self.scope
        self.plan = self.make_plan()
        self.pgs = []  # in creation order until all are ready (remove_placement's list)
        self.pgs = create_placement_groups(  # then in plan order: slot.pg indexes it
            [(self.pg_name(g.name), g) for g in self.plan.groups], self.alive_bad_nodes(),
            s.check_stop, made=self.pgs)
        s.emit("placement", policy=s.spec.placement, groups=self.plan.describe(),
               excluded_nodes=sorted(s.failover.bad_nodes))
        s.context.set("placement", self.plan.describe())

    def alive_bad_nodes(self) -> list[str]:
        """Nodes marked bad that are still in the cluster (kept out by label selector)."""
        return sorted(self.scope.failover.bad_nodes & {n.node_id for n in
                                                       ClusterResources.from_ray().nodes})

    def find_placement(self) -> bool:
        """Re-attach: plan again and look up the named placement groups an earlier
        master created; True when all of them exist."""
        self.plan = self.make_plan()
        self.pgs = []
        for g in self.plan.groups:
            try:
                self.pgs.append(ray.util.get_placement_group(self.pg_name(g.name)))
            except ValueError:
                self.pgs = []
                return False
        return True

    def remove_placement(self, spares_only: bool = False,
                         keep: frozenset[str] | set[str] = frozenset()) -> None:
        """Remove the job's placement groups, an earlier master's included: the spares'
        (``dlrover-<job>-<role>-spare-...``) and the groups of an elastic resize
        (``dlrover-<job>-<group>@<n>``; a restarted master plans the spec's groups
        again, and the resized ones it does not find would hold their resources: the
        start-over's placement could not be ready, found by the elastic chaos run).
        ``spares_only``: only the spares' groups (call before this master makes a
        spare: a re-attach that keeps the ranks' groups removes an earlier master's
        spare groups, which are detached and which nothing else removes; each held a
        rank's resources, took a node that joined, and failed a chaos run's grow and
        then its job), except those whose id (hex) is in ``keep`` (a promoted spare's
        rank runs in its group)."""
        pgs = [] if spares_only else list(self.pgs)
        roles = "|".join(re.escape(r) for r in self.scope.graph.roles)
        tail = r"-spare-.*" if spares_only else r"(?:-spare-.*|(?::\d+)?(?:@\d+)?)"
        mine = re.compile(rf"^{re.escape(self.pg_name(''))}(?:{roles}){tail}$")
        try:
            for info in ray.util.placement_group_table().values():
                if mine.match(str(info.get("name", ""))) and \
                        info.get("state") != "REMOVED" and \
                        info.get("placement_group_id") not in keep:
                    try:
                        pgs.append(ray.util.get_placement_group(info["name"]))
                    except ValueError:
                        pass
        except Exception:  # noqa: BLE001 - the table is a convenience
            pass
        for pg in pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        if not spares_only:
            self.pgs = []

    # ------------------------------------------------------------------ actors
    def worker_context(self, role: str, rank: int, attempt: int) -> WorkerContext:
        s = self.scope
        r = s.graph.roles[role]
        slot = self.plan.slots[(role, rank)]
        group = s.graph.group_of(role)
        config = OmegaConf.merge(s.spec.config, r.config or {})
        return WorkerContext(
            job=s.name, role=role, rank=rank, world_size=r.total,
            local_rank=slot.local_rank, local_world_size=slot.local_world_size,
            node_rank=slot.node_rank, backend=r.backend,
            collocation=",".join(group.roles) if len(group.roles) > 1 else "",
            config=OmegaConf.to_container(config, resolve=True),
            checkpoint=OmegaConf.to_container(s.spec.checkpoint),
            failover=OmegaConf.to_container(s.spec.failover),
            tuning=OmegaConf.to_container(s.spec.tuning),
            observability=OmegaConf.to_container(s.spec.observability),
            job_dir=s.job_dir, attempt=attempt, run_id=s.run_id,
            # the global batch reaches every role with a process group (data parallel)
            global_batch=int(s.spec.elastic.global_batch) if r.backend else 0,
            micro_batch=int(s.spec.elastic.micro_batch) if r.backend else 0)

    def device_env(self, role: str, gpu: float) -> dict[str, str]:
        """Environment that makes an actor of ``role`` asking for ``gpu`` GPUs see the
        devices the spec says (``enable_ray_auto_visible_device``; see
        :mod:`dlrover_core.runtime.devices`)."""
        from dlrover_core.runtime.devices import actor_env

        auto = bool(self.scope.spec.roles[role].get("enable_ray_auto_visible_device", False))
        return actor_env(gpu, auto)

    def create_instance(self, role: str, rank: int, attempt: int) -> Instance:
        """Create the actor of ``role``/``rank`` in its bundle (state ``starting``)."""
        s = self.scope
        r = s.graph.roles[role]
        slot = self.plan.slots[(role, rank)]
        name = f"dlrover-{s.name}-{role}-{rank}-a{attempt}"
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
        env = {**dict(r.env), **self.device_env(role, slot.resources.get("GPU", 0.0))}
        if env:
            opts["runtime_env"] = {"env_vars": env}
        handle = remote_workload_host().options(**opts).remote(
            r.workload, self.worker_context(role, rank, attempt))
        return s.instances.register(role, rank, handle, name, attempt)

    def await_refs(self, pairs: list[tuple[Instance, Any]],
                   timeout: float | None = None) -> list:
        """``ray.get`` each ``(instance, ref)``; the first failure raises
        ``InstanceFailure`` for its instance, so does a ref still pending after
        ``timeout`` s. Raises ``JobStopped`` once ``stop()`` is called."""
        out: dict[int, Any] = {}
        waiting = {ref: i for i, (_, ref) in enumerate(pairs)}
        deadline = None if timeout is None else time.time() + timeout
        while waiting:
            self.scope.check_stop()
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

    def setup_members(self, members: list[Instance], fresh: list[Instance],
                      heal: bool = False) -> None:
        """Rendezvous and ``setup()`` of some instances (all ranks of each role with a
        backend; ``fresh`` ones need their node info first). Survivors are set up again
        in place, in their running process. Each is then handed to the monitor.
        ``heal``: survivors are among them; a replicated role heals from their live
        state (``WorkloadHost.setup``)."""
        s = self.scope
        t0 = time.time()
        if fresh:
            infos = self.await_refs([(i, i.handle.node_info.remote()) for i in fresh])
            for inst, info in zip(fresh, infos):
                s.instances.set_node(inst, info)
        setups = []
        for role in dict.fromkeys(i.role for i in members):
            group = sorted((i for i in members if i.role == role), key=lambda i: i.rank)
            addr, port = "", 0
            world = s.graph.roles[role].total
            if s.graph.roles[role].backend:
                rank0 = s.instances.roles[(role, 0)]
                addr = rank0.ip
                port = self.await_refs([(rank0, rank0.handle.rendezvous_port.remote())])[0]
            topo = topology(s.instances.of_role(role, world))
            for inst in group:
                setups.append((inst, inst.handle.setup.remote(addr, port, inst.attempt,
                                                              *topo[inst.rank], heal=heal)))
        t_started = time.time()
        results = self.await_refs(setups)
        self.phases = {"actors_started_s": round(t_started - t0, 3),
                       "setup_s": round(time.time() - t_started, 3)}
        for key in ("import_s", "process_group_s", "user_setup_s"):  # slowest rank's
            self.phases[key] = max((r.get("timings", {}).get(key, 0.0) for r in results),
                                   default=0.0)
        for (inst, _), res in zip(setups, results):
            inst.last_report_ts = time.time()
            inst.reported = False
            inst.last_step_ts = 0.0  # this attempt's reports start afresh
            s.instances.set_state(inst, InstanceState.RUNNING)
            s.invocations.setdefault(inst.role, res.get("invocations", {}))
            s.emit("instance_started", role=inst.role, rank=inst.rank, pid=inst.pid,
                   node_id=inst.node_id, attempt=inst.attempt, in_place=inst not in fresh,
                   placement_group_id=inst.info.get("placement_group_id"),
                   bundle_index=bundle_index(inst.info.get("assigned_resources", {})),
                   **res["device"])
        for inst, _ in setups:
            self.monitor.watch_instance(inst)

    def start_roles(self, roles: list[str], attempts: dict[tuple[str, int], int]) -> None:
        """Create, rendezvous and set up every instance of ``roles`` (in parallel)."""
        g = self.scope.graph
        created = [self.create_instance(role, rank, attempts.get((role, rank), 0))
                   for role in roles for rank in range(g.roles[role].total)]
        self.setup_members(created, created)

    def driver_env(self) -> dict:
        """The driver actor's options for the job's ``env`` (``global_env``), which
        reaches the driver as it reaches every role."""
        env = {k: str(v) for k, v in dict(self.scope.spec.env or {}).items()}
        return {"runtime_env": {"env_vars": env}} if env else {}

    def start_driver(self, attempt: int = 0) -> None:
        """Create the driver actor with ``RoleGroup``s over the current instances, run
        its ``init()``, then its ``fit()`` under the monitor."""
        s = self.scope
        groups = {role: RoleGroup(role, [i.handle for i in s.instances.of_role(role, r.total)],
                                  s.invocations.get(role, {}))
                  for role, r in s.graph.roles.items()}
        tctx = TrainerContext(
            job=s.name, role_groups=groups,
            config=OmegaConf.to_container(s.spec.config, resolve=True),
            resources={role: {"cpu": r.resources.cpu, "gpu": r.resources.gpu}
                       for role, r in s.graph.roles.items()},
            job_dir=s.job_dir, attempt=attempt,
            workloads={role: r.workload for role, r in s.graph.roles.items()},
            observability=OmegaConf.to_container(s.spec.observability))
        name = f"dlrover-{s.name}-driver-a{attempt}"
        handle = remote_driver_host().options(
            name=name, namespace=MASTER_NAMESPACE, num_cpus=0, max_restarts=0,
            lifetime="detached", **self.driver_env()).remote(s.graph.driver, tctx)
        inst = s.instances.register(DRIVER, 0, handle, name, attempt)
        info = self.await_refs([(inst, handle.node_info.remote())])[0]
        s.instances.set_node(inst, info)
        self.await_refs([(inst, handle.setup.remote())])
        s.instances.set_state(inst, InstanceState.RUNNING)
        s.emit("instance_started", role=DRIVER, rank=0, pid=inst.pid, node_id=inst.node_id,
               attempt=attempt, **info["device"])
        self.monitor.watch_instance(inst)

    def start_everything(self, attempt_bump: int = 0) -> None:
        """Start every role (in graph order), then the driver; each instance's attempt
        is its previous one plus ``attempt_bump``. (The caller starts the standbys.)"""
        s = self.scope
        attempts = {k: i.attempt + attempt_bump for k, i in s.instances.roles.items()}
        self.start_roles(list(s.graph.order), attempts)
        if s.graph.driver:
            drv = s.instances.driver
            self.start_driver((drv.attempt + attempt_bump) if drv else 0)

    # ------------------------------------------------------------------ stopping
    def stop_instances(self, insts: list[Instance], graceful: bool = False) -> None:
        """Stop watching ``insts`` and kill their actors (``graceful``: ask each to
        ``shutdown()`` first, up to 10 s); their state becomes ``stopped``
        (graceful) or ``killed``, except for instances that already succeeded."""
        self.monitor.unwatch(insts)
        if graceful:
            refs = [i.handle.shutdown.remote() for i in insts if i.handle is not None]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=10)
        for i in insts:
            if i.handle is not None:
                kill_actor(i.handle)
            if i.state != InstanceState.SUCCEEDED:
                i.state = InstanceState.STOPPED if graceful else InstanceState.KILLED
