"""Re-attach: what a JobMaster that Ray restarted does first.

It reads the JobContext back (progress, checkpoint steps, failover budgets, the
instance table), finds the placement groups and the actors by name, asks each live
actor where it runs and how far it got (reports sent while the master was down are
lost), and kills the spares of the old master. It returns what it found; the
controller decides what follows (carry on, recover the lost instances, or start over).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    return JobState(ctx.get("state"))


def reattach(scope: JobScope, launcher: Launcher, monitor: Monitor,
             standby: StandbyPool) -> ReattachResult:
    """Find the previous master's placement groups and actors (see the module doc).
    Live instances are handed to the monitor again; the lost ones are returned."""
    t0 = time.time()
    previous = restore_scope(scope)
    found_pgs = launcher.find_placement()
    rows = scope.context.instances()
    for row in rows:
        inst = Instance.from_record(row)
        try:
            inst.handle = ray.get_actor(inst.actor_name, namespace=MASTER_NAMESPACE)
        except ValueError:
            inst.handle = None
        scope.instances.adopt(inst)
    scope.emit("master_restarted", previous_state=previous.value,
               instances=len(scope.instances.roles))
    standby.kill_previous(scope.context.get("standbys") or [])
    n_roles = sum(r.total for r in scope.graph.roles.values())
    intact = (previous == JobState.RUNNING and found_pgs
              and len(scope.instances.roles) == n_roles
              and (not scope.graph.driver or scope.instances.driver is not None))
    result = ReattachResult(previous, bool(intact))
    if not intact:
        return result
    for inst in scope.instances.all():
        if inst.state == InstanceState.SUCCEEDED:
            result.attached.append(inst)
        elif _probe(scope, inst):
            monitor.watch_instance(inst, reattached=True)
            result.attached.append(inst)
        else:
            result.lost.append(inst)
    scope.emit("master_reattached", attached=[i.label for i in result.attached],
               lost=[i.label for i in result.lost], seconds=round(time.time() - t0, 3))
    return result


def _probe(scope: JobScope, inst: Instance) -> bool:
    """Ask a live actor where it runs and, for a role instance, the progress it
    reported; False when it does not answer."""
    if inst.handle is None:
        return False
    try:
        info = ray.get(inst.handle.node_info.remote(), timeout=ACTOR_QUERY_TIMEOUT_S)
    except Exception:  # noqa: BLE001
        return False
    inst.node_id, inst.ip, inst.pid, inst.info = info["node_id"], info["ip"], info["pid"], info
    inst.state = InstanceState.RUNNING
    inst.last_report_ts = time.time()
    if inst.role != DRIVER:  # reports sent while the master was down are lost
        prog = ray.get(inst.handle.progress.remote(), timeout=ACTOR_QUERY_TIMEOUT_S)
        with scope.lock:
            if inst.rank == 0 and prog["step"] > scope.step:
                scope.step = prog["step"]
                scope.metrics.update(prog["metrics"])
            inst.last_step = max(inst.last_step, prog["step"])
    return True
