"""The recovery executor: carries out a ``RecoveryAction`` (the policy that chose it
is ``master.failover``).

- ``process`` / ``role``: :meth:`RecoveryExecutor.restart_in_place` replaces the
  failed instances of the role (a role with a process group re-forms it; survivors
  whose processes are intact are set up again in place), then restarts the driver
  (which rolls the stateful roles back to its last commit), unless the action keeps it
  running (``restart_driver`` false: a stateless role, ``roles.<role>.config.failover:
  replace``): the driver then finds the replacement (``JobMaster.role_instance``) and
  retries its call on it. The scope and why are in ``recovery_started``
  (:func:`dlrover_core.master.failover.graph_scope`).
- ``node`` / ``job``: :meth:`RecoveryExecutor.tear_down` stops every instance (and,
  for ``node``, removes the placement groups); the controller then re-enters
  ``PLACING`` (node) or ``STARTING`` (job) through its checked transition.

A recovery is open from ``recovery_started`` until the job is ``RUNNING`` again;
:meth:`RecoveryExecutor.finish` closes it with the ``recovery_finished`` event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from dlrover_core.builtin.failure import is_broken_collective
from dlrover_core.master.instances import DRIVER, Instance, InstanceFailure
from dlrover_core.plugins.records import FailoverLevel
from dlrover_core.runtime.script import SCRIPT_BACKEND

if TYPE_CHECKING:
    from dlrover_core.master.failover import RecoveryAction
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.monitor import Monitor
    from dlrover_core.master.scope import JobScope
    from dlrover_core.master.standby import StandbyPool
    from dlrover_core.plugins.records import Failure


@dataclass
class OpenRecovery:
    """A recovery in progress: the action, the failure, the start (unix s), rank 0's
    step when it failed, and the timings of its phases (s)."""

    action: RecoveryAction
    failure: Failure
    started: float
    step_at_failure: int
    phases: dict[str, Any] = field(default_factory=dict)


class RecoveryExecutor:
    def __init__(self, scope: JobScope, launcher: Launcher, monitor: Monitor,
                 standby: StandbyPool) -> None:
        self.scope = scope
        self.launcher = launcher
        self.monitor = monitor
        self.standby = standby

    def begin(self, action: RecoveryAction, failure: Failure) -> OpenRecovery:
        """Open a recovery and emit ``recovery_started``."""
        s = self.scope
        s.emit("recovery_started", level=action.level, roles=action.roles, role=failure.role,
               rank=failure.rank, restart_driver=action.restart_driver, scope=action.scope)
        return OpenRecovery(action, failure, time.time(), s.step)

    def tear_down(self, rec: OpenRecovery) -> None:
        """``node``/``job`` levels: drop the spares and kill every instance; ``node``
        also removes the placement groups (they are made again without the bad node)."""
        self.standby.drop()
        self.launcher.stop_instances(self.scope.instances.all())
        if rec.action.level == FailoverLevel.NODE:
            self.launcher.remove_placement()

    def restart_in_place(self, rec: OpenRecovery) -> None:
        """``process``/``role`` levels (and any failure of the driver).

        Raises:
            InstanceFailure: a replacement failed to start, or a node of the job turned
                out to be gone (the controller classifies it as a new failure).
        """
        s = self.scope
        action, failure = rec.action, rec.failure
        if failure.role == DRIVER:
            self._restart_driver()
            return
        for role in action.roles:
            ranks = [failure.rank] if action.level == FailoverLevel.PROCESS else \
                list(range(s.graph.roles[role].total))
            rec.phases = self.restart_role(role, ranks,
                                           reporter_may_survive=is_broken_collective(failure))
        if s.graph.driver and action.restart_driver:  # it held handles of the replaced actors
            self._restart_driver()

    def current_instance(self, role: str, rank: int) -> dict | None:
        """``{"attempt", "state", "handle"}`` of the instance now in ``role``'s slot
        ``rank`` (``None``: no such slot): a driver that kept running while a stateless
        role was replaced rebinds its role group to the new handle once it is
        ``running``."""
        s = self.scope
        with s.lock:
            inst = s.instances.get(role, rank)
            if inst is None:
                return None
            return {"attempt": inst.attempt, "state": str(inst.state.value),
                    "handle": inst.handle}

    def _restart_driver(self) -> None:
        drv = self.scope.instances.driver
        if drv is None:  # never started
            self.launcher.start_driver(0)
            return
        self.launcher.stop_instances([drv])
        self.launcher.start_driver(drv.attempt + 1)

    def restart_role(self, role: str, failed_ranks: list[int],
                     reporter_may_survive: bool = False) -> dict[str, Any]:
        """Replace the failed ranks of ``role``; returns the phase timings (s).

        A role with a process group re-forms it: survivors whose processes are intact
        leave their failed run (within ``failover.survivor_grace_s``) and are set up again
        in place (new rendezvous, checkpoint reload) instead of being killed, which saves
        a process start and the imports; stuck or dead ones are replaced. With
        ``failover.in_place: false`` every rank is replaced. In a script role
        (:mod:`dlrover_core.runtime.script`) the failed ranks' actors are kept too when
        they are alive (only their script died): every rank starts its script again in
        its own actor. ``reporter_may_survive``: the failure was a broken collective (a
        survivor that saw a dead peer first, before the peer's death was seen): the failed
        ranks are probed like survivors, so a rank whose process is intact stays in place.
        With survivors in place and no driver in the job, the ranks are asked to heal
        (``setup(heal=True)``): a replicated role (DDP) takes a survivor's live state at
        its current step instead of the checkpoint (:mod:`dlrover_core.checkpoint.heal`).
        """
        s = self.scope
        r = s.graph.roles[role]
        members = s.instances.of_role(role, r.total)
        if r.backend and not s.spec.failover.in_place:
            failed_ranks = list(range(r.total))
        failed = [m for m in members if m.rank in failed_ranks]
        others = [m for m in members if m.rank not in failed_ranks]
        if reporter_may_survive and r.backend and s.spec.failover.in_place:
            failed, others = [], others + failed
        if r.backend == SCRIPT_BACKEND and s.spec.failover.in_place:
            # a script role's actor outlives its script: every actor that is still alive
            # starts the script again in place (torchrun's agent restarting its workers);
            # a dead actor fails the liveness probe below and is replaced
            failed, others = [], members
        t0 = time.time()
        aborts = self._abort_collectives(others) if r.backend and others else {}
        self.launcher.stop_instances(failed)  # survivors in a collective with them fail fast
        survivors: list[Instance] = []
        if r.backend and others:
            self.monitor.unwatch(others)
            grace = float(s.spec.failover.survivor_grace_s)
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
            self.launcher.stop_instances([m for m in failed if m in others])
        t_survivors = time.time()
        self._check_nodes_still_there(failed)
        fresh = []
        for m in sorted(failed, key=lambda i: i.rank):
            inst = self.standby.take(role, m.rank, m.attempt + 1)
            fresh.append(inst or self.launcher.create_instance(role, m.rank, m.attempt + 1))
        for m in survivors:
            m.attempt += 1
            m.generation += 1
        if r.backend:
            # survivors in place: a replicated role heals from their live state, unless a
            # driver's commit is the job's consistent point (it rolls the roles back)
            self.launcher.setup_members(sorted(fresh + survivors, key=lambda i: i.rank), fresh,
                                        heal=bool(survivors) and not s.graph.driver)
        else:
            self.launcher.setup_members(fresh, fresh)
        self.standby.ensure()
        return {"survivors_s": round(t_survivors - t0, 3), "survivor_abort": aborts,
                "standby_used": any("standby" in i.actor_name for i in fresh),
                "replace_and_setup_s": round(time.time() - t_survivors, 3),
                **self.launcher.phases}

    def _check_nodes_still_there(self, failed: list[Instance]) -> None:
        """Before replacing ``failed``: when a node of the job is gone by now, this is
        a lost node, not a process failure. A node that dies whole (every process
        SIGKILLed at once) shows first as its rank's dead actor, and its raylet may
        still take a connection for a moment, so the first diagnosis said "process".
        Costs one raylet probe; the survivors' phase before it gave the node time.

        Raises:
            InstanceFailure: a job node is gone (the controller diagnoses it again as
                ``node_lost`` and recovers at the node level).
        """
        if not failed:
            return
        gone = self.monitor.lost_node(failed[0])
        if gone is None:
            return
        blame = next((m for m in failed if m.node_id == gone), failed[0])
        raise InstanceFailure(blame, ray.exceptions.ActorDiedError())

    @staticmethod
    def _abort_collectives(survivors: list[Instance], timeout: float = 5.0) -> dict[str, str]:
        """Ask each survivor to abort its process groups (``WorkloadHost.abort_collectives``:
        NCCL aborts, gloo needs nothing); label -> what it did."""
        probes = {m.handle.abort_collectives.remote(): m for m in survivors
                  if m.handle is not None}
        if not probes:
            return {}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout)
        out = {m.label: "no answer" for m in probes.values()}
        for ref in ready:
            try:
                out[probes[ref].label] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - dead: replaced below anyway
                out[probes[ref].label] = f"failed: {type(exc).__name__}"
        return out

    def finish(self, rec: OpenRecovery) -> None:
        """Close the recovery (the job is running again): count it, persist the
        failover state, emit ``recovery_finished`` with the steps lost."""
        s = self.scope
        s.failover.recovered(rec.action)
        s.context.set("failover", s.failover.snapshot())
        resumed = dict(s.checkpoint_steps)
        lost = None
        if rec.failure.role in resumed and rec.step_at_failure >= 0:
            lost = max(0, rec.step_at_failure + 1 - resumed[rec.failure.role])
        s.emit("recovery_finished", level=rec.action.level,
               seconds=round(time.time() - rec.started, 3),
               step_at_failure=rec.step_at_failure, resumed_from_checkpoint=resumed,
               steps_lost=lost, phases=rec.phases)
