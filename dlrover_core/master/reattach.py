"""Re-attach: what a JobMaster that Ray restarted does first.

It reads the JobContext back (progress, checkpoint steps, failover budgets, the
instance table, the step-report agents), finds the placement groups, and kills the
spares of the old master. Then it learns where each live instance runs and how far it
got (reports sent while the master was down are lost):

- from the agents (:mod:`dlrover_core.runtime.node_reporter`): one
  ``roster(node_id)`` call per node that has one, all in flight at once; a rank the
  agent lists, alive, under the actor name of the instance's record is attached with
  the agent's handle, ``node_info`` and newest step, without a call to the rank;
- every other instance (rank 0 of a role, small roles, the driver, a rank no agent
  listed) by name and two calls to its actor (``node_info``, ``progress``), all
  instances' calls in flight at once, each answered within
  :data:`ACTOR_QUERY_TIMEOUT_S` of the first or counted lost.

So a master of N ranks on M nodes makes about M + (ranks not behind an agent) calls,
not 2N one after another. Last, it removes the old master's spare placement groups
that no attached instance runs in (they are detached: only their actors were
killed). It returns what it found; the controller decides what follows (carry on,
recover the lost instances, or start over).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from dlrover_core.master.instances import DRIVER, Instance, InstanceState
from dlrover_core.master.states import JobState
from dlrover_core.runtime.context import MASTER_NAMESPACE

if TYPE_CHECKING:
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.monitor import Monitor
    from dlrover_core.master.scope import JobScope
    from dlrover_core.master.standby import StandbyPool

ACTOR_QUERY_TIMEOUT_S = 10.0


@dataclass
class ReattachResult:
    """``previous``: the persisted job state; ``intact``: the placement groups and every
    instance's record were found, so the job can go on where it was (else it starts
    over from its checkpoints); ``attached`` / ``lost``: instances found alive / dead."""

    previous: JobState
    intact: bool
    attached: list[Instance] = field(default_factory=list)
    lost: list[Instance] = field(default_factory=list)


def restore_scope(scope: JobScope) -> JobState:
    """Load the persisted progress and failover state into ``scope``; returns the job
    state the previous master persisted."""
    ctx = scope.context
    scope.started_at = ctx.get("started_at", scope.started_at)
    progress = ctx.get("progress") or {}
    scope.step = progress.get("step", -1)
    scope.metrics = progress.get("metrics", {})
    scope.step_times = {int(k): v for k, v in (ctx.get("step_times") or {}).items()}
    scope.checkpoint_steps = ctx.get("checkpoint_steps") or {}
    scope.resumed_from = ctx.get("resumed_from") or {}
    scope.failover.restore(ctx.get("failover") or {})
    scope.agents = dict(ctx.get("agents") or {})
    return JobState(ctx.get("state"))


def reattach(scope: JobScope, launcher: Launcher, monitor: Monitor,
             standby: StandbyPool) -> ReattachResult:
    """Find the previous master's placement groups and actors (see the module doc).
    Live instances are handed to the monitor again; the lost ones are returned. The
    ``master_reattached`` event has ``seconds`` (the whole re-attach) and
    ``from_agents`` (instances attached from an agent's roster)."""
    t0 = time.time()
    previous = restore_scope(scope)
    found_pgs = launcher.find_placement()
    for row in scope.context.instances():
        scope.instances.adopt(Instance.from_record(row))
    scope.emit("master_restarted", previous_state=previous.value,
               instances=len(scope.instances.roles))
    standby.kill_previous(scope.context.get("standbys") or [])
    table = scope.instances
    # exactly the graph's ranks (rows of ranks a shrink removed mean: start over); rows
    # of a role outside the graph (benchmarks/master_scale.py's simulated ranks) are
    # attached or lost like the others
    expected = {(name, k) for name, r in scope.graph.roles.items() for k in range(r.total)}
    intact = (previous == JobState.RUNNING and found_pgs
              and {k for k in table.roles if k[0] in scope.graph.roles} == expected
              and (not scope.graph.driver or table.driver is not None))
    result = ReattachResult(previous, bool(intact))
    if not intact:  # the controller stops them all: it needs their handles
        _look_up(table.all())
        return result
    todo = []
    for inst in table.all():
        if inst.state == InstanceState.SUCCEEDED:
            inst.handle = _handle(inst.actor_name)
            result.attached.append(inst)
        else:
            todo.append(inst)
    from_agents = _attach_from_agents(scope, todo)
    rest = [i for i in todo if i.key not in from_agents or i.role == DRIVER]
    alive = _probe_all(scope, rest)
    for inst in todo:
        if (inst.role != DRIVER and inst.key in from_agents) or id(inst) in alive:
            monitor.watch_instance(inst, reattached=True)
            result.attached.append(inst)
        else:
            result.lost.append(inst)
    # the old master's spares' groups (detached) no rank runs in: a promoted spare's
    # rank runs in its spare's group, which stays
    launcher.remove_placement(spares_only=True, keep={
        i.info.get("placement_group_id") for i in result.attached if i.info} - {None})
    scope.emit("master_reattached", attached=[i.label for i in result.attached],
               lost=[i.label for i in result.lost], from_agents=len(from_agents),
               seconds=round(time.time() - t0, 3))
    return result


def _handle(actor_name: str) -> Any:
    try:
        return ray.get_actor(actor_name, namespace=MASTER_NAMESPACE)
    except ValueError:
        return None


def _look_up(insts: list[Instance]) -> None:
    for inst in insts:
        inst.handle = _handle(inst.actor_name)


def _attach_from_agents(scope: JobScope, todo: list[Instance]) -> set:
    """Ask the agent of every node an instance of ``todo`` ran on for its ranks (one
    call per node, all in flight, :data:`ACTOR_QUERY_TIMEOUT_S` in all); attach each
    listed rank that is alive and is the instance of the record (same actor name).
    Returns the keys attached."""
    wanted = {i.key: i for i in todo if i.role != DRIVER}
    nodes = {i.node_id for i in wanted.values() if i.node_id in scope.agents}
    refs = []
    for node_id in nodes:
        agent = _handle(scope.agents[node_id])
        if agent is not None:
            refs.append(agent.roster.remote(node_id))
    attached: set = set()
    if not refs:
        return attached
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ACTOR_QUERY_TIMEOUT_S)
    now = time.time()
    for ref in ready:
        try:
            entries = ray.get(ref)
        except Exception:  # noqa: BLE001 - that agent died: its ranks are probed
            continue
        for e in entries:
            inst = wanted.get((e["role"], e["rank"]))
            if inst is None or not e["alive"] or e["actor_name"] != inst.actor_name:
                continue
            info = e["info"]
            inst.handle = e["handle"]
            inst.node_id, inst.ip, inst.pid, inst.info = (info["node_id"], info["ip"],
                                                          info["pid"], info)
            inst.state = InstanceState.RUNNING
            inst.last_report_ts = now
            inst.last_step = max(inst.last_step, e["step"])
            attached.add(inst.key)
    return attached


def _probe_all(scope: JobScope, insts: list[Instance]) -> set[int]:
    """Ask each live actor of ``insts`` where it runs and, for a role instance, the
    progress it reported: every call in flight at once, each phase answered within
    :data:`ACTOR_QUERY_TIMEOUT_S`. Returns the ``id()`` of the instances that
    answered."""
    _look_up(insts)
    infos = _answers([(inst, inst.handle.node_info.remote()) for inst in insts
                      if inst.handle is not None])
    now = time.time()
    for inst, info in infos:
        inst.node_id, inst.ip, inst.pid, inst.info = (info["node_id"], info["ip"],
                                                      info["pid"], info)
        inst.state = InstanceState.RUNNING
        inst.last_report_ts = now
    progress = _answers([(inst, inst.handle.progress.remote()) for inst, _ in infos
                         if inst.role != DRIVER])
    for inst, prog in progress:
        with scope.lock:
            if inst.rank == 0 and prog["step"] > scope.step:
                scope.step = prog["step"]
                scope.metrics.update(prog["metrics"])
            inst.last_step = max(inst.last_step, prog["step"])
    return ({id(i) for i, _ in infos if i.role == DRIVER}
            | {id(i) for i, _ in progress})


def _answers(calls: list[tuple[Instance, Any]]) -> list[tuple[Instance, Any]]:
    """``[(inst, ref)]`` -> ``[(inst, value)]`` of the calls answered (without an
    error) within :data:`ACTOR_QUERY_TIMEOUT_S`."""
    if not calls:
        return []
    ready, _ = ray.wait([ref for _, ref in calls], num_returns=len(calls),
                        timeout=ACTOR_QUERY_TIMEOUT_S)
    ready = set(ready)
    out = []
    for inst, ref in calls:
        if ref not in ready:
            continue
        try:
            out.append((inst, ray.get(ref)))
        except Exception:  # noqa: BLE001 - dead or failing: lost
            continue
    return out
