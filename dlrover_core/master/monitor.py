"""The monitor: turns what Ray tells the master into ``Failure``s. It never recovers.

It keeps one pending Ray call per running instance (``run()`` of an SPMD worker or
the driver, ``wait_stopped()`` of a role instance that a driver calls, ``wait_run()``
after a re-attach), so an actor's death or its user code's exception shows up as soon
as Ray knows. :meth:`Monitor.poll` also checks, on its own clock, for nodes that left
the cluster and for instances that stopped reporting (hangs). Whatever it finds comes
back as a ``Detection``: the instance and the ``Failure`` to classify.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray

from dlrover_core.master.instances import DRIVER, Instance, InstanceState
from dlrover_core.master.raylet_probe import first_gone
from dlrover_core.plugins.records import Failure, FailureKind
from dlrover_core.runtime.errors import WorkloadError
from dlrover_core.runtime.script import SCRIPT_BACKEND

if TYPE_CHECKING:
    from dlrover_core.master.scope import JobScope

POLL_S = 0.25
NODE_CHECK_S = 1.0


def failure_from_exception(inst: Instance, exc: BaseException) -> Failure:
    """Turn what ``ray.get`` raised for ``inst`` into a ``Failure``: a ``WorkloadError``
    (user code raised, with its traceback) is ``user_error``; a dead actor is
    ``actor_died``; anything else (a start-up timeout) is ``user_error`` too."""
    cause = getattr(exc, "cause", None)
    werr = exc if isinstance(exc, WorkloadError) else cause if isinstance(cause, WorkloadError) \
        else None
    where = {"node_id": inst.node_id, "attempt": inst.attempt}
    if werr is not None:
        return Failure.user_error(inst.role, inst.rank, werr.exc_type, werr.message,
                                  werr.traceback, phase=werr.phase, step=werr.step, **where)
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError)):
        text = str(exc).strip()
        return Failure.actor_died(inst.role, inst.rank,
                                  text.splitlines()[0][:500] if text else "actor died",
                                  exc_type=type(exc).__name__, phase=inst.phase,
                                  step=inst.last_step, **where)
    return Failure.user_error(inst.role, inst.rank, type(exc).__name__, str(exc)[:500],
                              "".join(traceback.format_exception(exc)), phase=inst.phase,
                              step=inst.last_step, **where)


#: calls of a method a rank must have finished before its default hang bound applies
CALL_HANG_MIN_CALLS = 5


def call_hang_bound(activity: dict, floor_s: float) -> float | None:
    """The default hang bound (s) of a driver's call that a rank is running, from
    ``WorkloadHost.activity()``: max(``floor_s``, 10 x the p99 of that method's recent
    durations on the rank), or ``None`` (no bound: ``floor_s`` is 0, or fewer than
    :data:`CALL_HANG_MIN_CALLS` calls of the method finished, e.g. a first evaluation)."""
    recent = activity.get("recent")
    if floor_s <= 0 or not recent or recent["calls"] < CALL_HANG_MIN_CALLS:
        return None
    return max(floor_s, 10.0 * float(recent["p99_s"]))


@dataclass(frozen=True)
class Detection:
    """A failure the monitor found: ``inst`` is the instance to blame."""

    inst: Instance
    failure: Failure


class Monitor:
    """Watches the running instances of one job."""

    def __init__(self, scope: JobScope) -> None:
        self.scope = scope
        #: ref -> (kind, (role, rank), generation); kind: run | watch | run_wait
        self.pending: dict[Any, tuple[str, tuple[str, int], int]] = {}
        self._last_node_check = 0.0
        self._last_hang_check = 0.0
        #: nodes that hosted an instance of this job (a replacement not yet started
        #: has no node; the node its predecessor ran on is still suspect)
        self._job_nodes: dict[str, None] = {}

    # ------------------------------------------------------------------ watching
    def watch_instance(self, inst: Instance, reattached: bool = False) -> None:
        """Start the instance's work and watch it: ``run()`` (SPMD roles and the driver)
        or a liveness watch (roles a driver calls). ``reattached``: the work already
        runs; wait for its outcome (``wait_run()``) instead of starting it again."""
        if inst.role != DRIVER and self.scope.graph.driver:
            self._track(inst.handle.wait_stopped.remote(), "watch", inst)
        elif reattached:
            self._track(inst.handle.wait_run.remote(), "run_wait", inst)
        else:
            self._track(inst.handle.run.remote(), "run", inst)

    def _track(self, ref: Any, kind: str, inst: Instance) -> None:
        self.pending[ref] = (kind, inst.key, inst.generation)

    def unwatch(self, insts: list[Instance]) -> None:
        """Forget the pending calls of ``insts`` (they are being replaced or stopped)."""
        keys = {(i.key, i.generation) for i in insts}
        for ref in [r for r, (_, k, g) in self.pending.items() if (k, g) in keys]:
            del self.pending[ref]

    # ------------------------------------------------------------------ polling
    def finished(self) -> bool:
        """True when the job's work is done: the driver's ``fit()`` returned, or every
        SPMD instance's ``run()`` did."""
        table = self.scope.instances
        if self.scope.graph.driver:
            return table.driver is not None and table.driver.state == InstanceState.SUCCEEDED
        return bool(table.roles) and all(i.state == InstanceState.SUCCEEDED
                                         for i in table.roles.values())

    def poll(self, timeout: float = POLL_S) -> Detection | None:
        """Wait up to ``timeout`` s for a watched call to end; record successes; return
        the first failure found (a failed call, a lost node, a hang) or ``None``."""
        s = self.scope
        if not self.pending:
            return None
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        for ref in ready:
            entry = self.pending.pop(ref, None)
            if entry is None:
                continue
            kind, (role, rank), gen = entry
            inst = s.instances.get(role, rank)
            if inst is None or inst.generation != gen:
                continue
            try:
                out = ray.get(ref)
                if kind == "run_wait" and not out["ok"]:
                    raise out["error"]
            except Exception as exc:  # noqa: BLE001
                return self.diagnose(inst, exc)
            if kind in ("run", "run_wait"):
                self._succeeded(inst)
        return self.check_nodes() or self.check_hang()

    def _succeeded(self, inst: Instance) -> None:
        s = self.scope
        s.instances.set_state(inst, InstanceState.SUCCEEDED)
        s.emit("instance_finished", role=inst.role, rank=inst.rank, step=inst.last_step)
        if inst.role != DRIVER:
            s.pm.workload_stopped(s.name, inst.role, inst.rank, "succeeded")

    # ------------------------------------------------------------------ diagnosis
    def diagnose(self, inst: Instance, exc: BaseException) -> Detection:
        """The failure behind ``exc`` raised for ``inst``: a dead actor on a node that
        left is ``node_lost``; a driver that failed because a role instance died blames
        that instance."""
        failure = failure_from_exception(inst, exc)
        lost = self.lost_node(inst) if failure.kind != FailureKind.NODE_LOST else None
        if lost is not None:
            failure = Failure.node_lost(inst.role, inst.rank, lost, failure.message,
                                        phase=failure.phase, step=failure.step,
                                        attempt=failure.attempt)
        if failure.role == DRIVER and failure.kind != FailureKind.NODE_LOST:
            dead = self.dead_instances()
            if dead:  # the driver failed because a role instance died: recover that
                return self.diagnose(dead[0], ray.exceptions.ActorDiedError())
        return Detection(inst, failure)

    def lost_node(self, inst: Instance) -> str | None:
        """A node of this job that is gone (Ray calls it dead, or its raylet refuses a
        connection: :mod:`dlrover_core.master.raylet_probe`), ``inst``'s own first.

        A whole node lost at once shows first as some rank's error: the dead rank's
        actor, or a survivor's broken collective, often before Ray's GCS marks the node
        dead. Whichever failure comes first, a gone node makes it a lost node, so the
        recovery re-places the ranks instead of restarting them in place on it. Nodes
        an earlier recovery already excluded (``failover.bad_nodes``) are left out."""
        for i in self.scope.instances.all():
            if i.node_id:
                self._job_nodes[i.node_id] = None
        handled = self.scope.failover.bad_nodes  # excluded by an earlier recovery
        nodes = ([inst.node_id] if inst.node_id else []) + [
            n for n in self._job_nodes if n != inst.node_id]
        return first_gone([n for n in nodes if n not in handled])

    def dead_instances(self, timeout: float = 2.0) -> list[Instance]:
        """Running role instances that do not answer a ping (dead actors)."""
        live = [i for i in self.scope.instances.roles.values()
                if i.state == InstanceState.RUNNING]
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

    def check_nodes(self) -> Detection | None:
        """A node that left the cluster is a ``node_lost`` failure of its instances
        (checked at most every ``NODE_CHECK_S`` s)."""
        now = time.time()
        if now - self._last_node_check < NODE_CHECK_S:
            return None
        self._last_node_check = now
        alive = alive_nodes()
        for inst in self.scope.instances.all():
            if inst.state == InstanceState.RUNNING and inst.node_id and \
                    inst.node_id not in alive:
                return Detection(inst, Failure.node_lost(
                    inst.role, inst.rank, inst.node_id, step=inst.last_step,
                    attempt=inst.attempt))
        return None

    def check_hang(self) -> Detection | None:
        """Hangs, per role, with ``failover.hang_timeout_s`` (0: off), checked at most
        every quarter of it (and every second at most):

        - a role without a driver (SPMD ``run()``): an instance without a step report
          for the timeout (a script role's rank only once it has reported a step in
          its attempt: a plain script reports none). All ranks of a collective stop
          together, so the blame goes
          by :meth:`blame`: the silent rank that is not waiting inside torch (a
          collective, backward) for its peers, else the one whose progress stopped
          first (lowest last step, then earliest step end);
        - roles a driver calls: a role call (``WorkloadHost.call``) running longer than
          the timeout; the blame goes the same way among the stuck calls.
        """
        s = self.scope
        hang_s = float(s.spec.failover.hang_timeout_s or 0)
        floor_s = float(s.failover_option("call_hang_min_s") or 0)
        if hang_s <= 0 and not (s.graph.driver and floor_s > 0):
            return None
        now = time.time()
        if now - self._last_hang_check < (min(1.0, hang_s / 4) if hang_s > 0
                                          else min(5.0, floor_s / 4)):
            return None
        self._last_hang_check = now
        running = [i for i in s.instances.roles.values() if i.state == InstanceState.RUNNING]
        if s.graph.driver:
            return self._stuck_calls(running, hang_s, floor_s)
        quiet_since = max(s.failover.last_recovery_end, s.started_at)
        by_role: dict[str, list[Instance]] = {}
        for inst in running:
            if not inst.reported and self._is_script_role(inst.role):
                continue
            by_role.setdefault(inst.role, []).append(inst)
        for insts in by_role.values():
            silent = {i.key: now - max(i.last_report_ts, quiet_since) for i in insts}
            if max(silent.values()) <= hang_s:
                continue
            # a collective stops every rank at once: judge all ranks silent for half
            # the timeout, not only the first one past it
            suspects = [i for i in insts if silent[i.key] > hang_s / 2]
            inst, why = self.blame(suspects)
            return Detection(inst, replace(Failure.hang(
                inst.role, inst.rank, silent[inst.key], hang_s, node_id=inst.node_id,
                step=inst.last_step, attempt=inst.attempt),
                message=f"no step report for {silent[inst.key]:.1f} s "
                        f"(hang_timeout_s={hang_s:g}); {why}{self._stacks(inst, suspects)}"))
        return None

    def _is_script_role(self, role: str) -> bool:
        r = self.scope.spec.roles.get(role)
        return r is not None and r.backend == SCRIPT_BACKEND

    def _stacks(self, inst: Instance, suspects: list[Instance]) -> str:
        """Capture the suspects' stacks (``master.stacks``); the text that names the
        blamed rank's file in the failure message ('' when none was written)."""
        from dlrover_core.master.stacks import capture_hang_stacks

        try:
            files = capture_hang_stacks(self.scope, inst, suspects)
        except Exception:  # noqa: BLE001 - evidence only
            traceback.print_exc()
            return ""
        return f"; stacks: {files[inst.label]}" if inst.label in files else ""

    def _stuck_calls(self, running: list[Instance], hang_s: float,
                     floor_s: float = 0.0) -> Detection | None:
        """Driver jobs: role instances whose current call runs longer than ``hang_s``,
        or, with ``hang_s`` 0, than :func:`call_hang_bound` (the default bound from the
        method's recent durations on that rank, at least ``floor_s``)."""
        acts = self.activities(running)
        bounds = {i.key: hang_s if hang_s > 0 else call_hang_bound(acts[i.key], floor_s)
                  for i in running if acts.get(i.key) and acts[i.key]["busy"]}
        stuck = [i for i in running if bounds.get(i.key) is not None
                 and acts[i.key]["busy_s"] > bounds[i.key]]
        if not stuck:
            return None
        inst, why = self.blame(stuck, acts)
        a = acts[inst.key]
        bound = bounds[inst.key]
        rule = (f"hang_timeout_s={hang_s:g}" if hang_s > 0 else
                f"bound {bound:.1f} s = max(failover.call_hang_min_s={floor_s:g}, 10 x p99 "
                f"{a['recent']['p99_s']:.3f} s of its last {a['recent']['calls']} calls)")
        return Detection(inst, replace(Failure.hang(
            inst.role, inst.rank, a["busy_s"], bound, node_id=inst.node_id,
            step=inst.last_step, attempt=inst.attempt),
            message=f"call {inst.role}.{a['busy']} has run for {a['busy_s']:.1f} s "
                    f"({rule}); {why}{self._stacks(inst, stuck)}"))

    def activities(self, insts: list[Instance],
                   timeout: float = 5.0) -> dict[tuple[str, int], dict]:
        """``WorkloadHost.activity()`` by ``(role, rank)`` of each instance that answers
        within ``timeout`` s."""
        probes = {i.handle.activity.remote(): i for i in insts if i.handle is not None}
        if not probes:
            return {}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout)
        out = {}
        for ref in ready:
            try:
                out[probes[ref].key] = ray.get(ref)
            except Exception:  # noqa: BLE001 - dead: the pending run() reports that
                pass
        return out

    def blame(self, suspects: list[Instance],
              acts: dict[tuple[str, int], dict] | None = None) -> tuple[Instance, str]:
        """The instance to blame among ``suspects`` (all stopped or stuck) and why: the
        ones busy outside torch (stuck in their own code, not waiting for peers in a
        collective) first; among those, the one whose progress stopped first: lowest
        ``last_step``, then earliest ``last_step_ts``, then rank."""
        acts = self.activities(suspects) if acts is None else acts
        own = [i for i in suspects if acts.get(i.key) and acts[i.key]["busy"]
               and not acts[i.key]["in_torch"]]
        pool = own or suspects

        def first_stopped(i: Instance) -> tuple:
            return (i.last_step, i.last_step_ts or i.last_report_ts, i.rank)

        inst = min(pool, key=first_stopped)
        if own:
            stack = acts[inst.key]["stack"]
            top = stack.strip().splitlines()[-2:] if stack else []
            why = (f"{inst.label} is busy in its own code, not waiting in torch "
                   f"({len(own)} of {len(suspects)} suspects); innermost: "
                   + " | ".join(x.strip() for x in top))
        else:
            why = (f"{inst.label} stopped first (last step {inst.last_step}) of "
                   f"{len(suspects)} suspects")
        return inst, why


def alive_nodes() -> set[str]:
    """Node ids of the alive Ray nodes."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def node_alive(node_id: str) -> bool:
    return node_id in alive_nodes()
