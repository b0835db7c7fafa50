"""The FailoverCoordinator: from a classified failure to a recovery action, with
budgets and escalation.

Levels, smallest first: ``process`` (restart the failed instance; for a role with
a process group, the role's group is re-formed, so its ranks restart together and
reload the latest checkpoint), ``role`` (restart every instance of the role),
``node`` (mark the node bad, re-place everything on the other nodes), ``job``
(restart every role and the driver), ``fatal`` (stop with the error).

Budgets: ``failover.max_restarts`` recoveries in all; an exhausted budget makes the
failure fatal. ``failover.max_node_failures`` node-attributable failures on one node
escalate to ``node`` (when other nodes remain). Node-attributable
(:func:`node_attributable`): a classifier's ``node`` verdict, or an actor that died
with a node-level cause in Ray's message (its node or raylet died, the node ran out of
memory). A user exception or a plain process death on a healthy node does not count.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from dlrover_core.plugins.records import Failure, FailureKind, FailoverLevel, FailureVerdict

if TYPE_CHECKING:
    from dlrover_core.graph.graph import ComputationGraph


#: Phrases of Ray's actor-death messages that blame the node, not the process.
NODE_CAUSES = ("node has died", "node died", "node is dead", "node was terminated",
               "raylet", "running low on memory", "node failure")


def node_attributable(failure: Failure, verdict: FailureVerdict) -> bool:
    """Whether ``failure`` counts toward the node's ``failover.max_node_failures``: a
    ``node`` verdict, a lost node, or an actor death whose message names a node-level
    cause (:data:`NODE_CAUSES`)."""
    if verdict.level == FailoverLevel.NODE or failure.kind == FailureKind.NODE_LOST:
        return True
    if failure.kind == FailureKind.ACTOR_DIED:
        text = failure.message.lower()
        return any(cause in text for cause in NODE_CAUSES)
    return False


def what_was_running(failure: Failure, set_up: bool, graph: ComputationGraph,
                     driver_step: int) -> Failure:
    """``failure`` with the phase and step of what was really running.

    ``set_up``: the instance had finished its ``setup()`` (the master saw it
    ``running``): a death or hang of it is in phase ``run`` even when it never reported a step itself (a role
    that a driver calls, e.g. a rollout worker that served 16 iterations). The step of
    such a role (which reports none: ``-1``) is the driver's last reported step
    (``driver_step``), so that the record says which iteration it was serving and the
    classifier's "same error at the same step" rule compares iterations."""
    from dataclasses import replace

    changes: dict[str, Any] = {}
    # a user error carries the phase the worker was in; a death or a hang only the
    # master's guess from the instance's own step reports
    phase = "run" if set_up and failure.kind != FailureKind.USER_ERROR else failure.phase
    if phase != failure.phase:
        changes["phase"] = phase
    served = bool(graph.driver) and failure.role in graph.roles
    if served and phase == "run" and failure.step < 0 and driver_step >= 0:
        changes["step"] = driver_step
    return replace(failure, **changes) if changes else failure


class JobFailed(RuntimeError):
    """The job cannot go on; the message is the summary's ``error``."""


@dataclass
class RecoveryAction:
    """``level``: what the master does; ``roles``: the roles it restarts (for
    ``process``/``role``); ``verdict``: the classifier's answer that led here.
    ``restart_driver``: whether the driver restarts (``False``: it keeps running and
    retries its call on the replacement); ``scope``: what is restarted, rolled back and
    retried, and ``why`` (see :func:`graph_scope`), for ``recovery_started``."""

    level: FailoverLevel
    verdict: FailureVerdict
    roles: list[str] = field(default_factory=list)
    restart_driver: bool = True
    scope: dict = field(default_factory=dict)


def graph_scope(failure: Failure, level: FailoverLevel, roles: list[str],
                graph: ComputationGraph) -> tuple[bool, dict]:
    """What a ``process``/``role`` recovery of ``failure`` touches, decided by the graph
    (seed 000's failover topology): ``(restart_driver, scope)``.

    - a role whose policy is ``replace`` (stateless: rollout, reward, reference,
      :meth:`ComputationGraph.failover_policy`): its failed ranks are replaced, the driver
      keeps running and retries its in-flight call on the replacement (idempotent by
      iteration); nothing is rolled back.
    - a ``rollback`` role (stateful: actor, critic): its failed ranks are replaced and
      the driver restarts; what depends on the role (its downstream in the graph) and
      every other ``rollback`` role go back to the driver's last commit with it.
    - the driver: it restarts and rolls every ``rollback`` role back to its commit.

    ``scope``: ``{"restart": [...], "rollback": [...], "retry": [...], "why": str}``
    (instance labels / role names)."""
    role = failure.role
    if level not in (FailoverLevel.PROCESS, FailoverLevel.ROLE) or graph is None \
            or not graph.driver:
        return True, {}
    what = (f"{role}-{failure.rank}" if level == FailoverLevel.PROCESS else role)
    stateful = [r for r in graph.order if graph.failover_policy(r) == "rollback"]
    if role == "driver":
        return True, {"restart": ["driver"], "rollback": ["driver", *stateful], "retry": [],
                      "why": "the driver restarts from its last commit and rolls the "
                             f"stateful roles ({', '.join(stateful) or 'none'}) back to it"}
    if role in graph.roles and graph.failover_policy(role) == "replace" and roles:
        return False, {"restart": [what], "rollback": [], "retry": [f"driver -> {role}"],
                       "why": f"{role} is stateless (roles.{role}.config.failover=replace): "
                              f"{what} is replaced and the driver retries its call on it, "
                              "without a restart or a redone iteration"}
    dependents = graph.depends_on(role) if role in graph.roles else []
    back = [r for r in graph.order if r == role or r in dependents or r in stateful]
    return True, {"restart": [what, "driver"], "rollback": ["driver", *back], "retry": [],
                  "why": f"{role} holds state (roles.{role}.config.failover=rollback): the "
                         f"driver restarts and rolls {', '.join(back)} (the role, what depends "
                         "on it in the graph, and the other stateful roles of the commit) "
                         "back to its last commit"}


class FailoverCoordinator:
    """Args:
        config: the job's ``failover`` section.
        plugin_manager: classifies failures (``classify_failure``).
        alive_nodes: returns the ids of the alive nodes (default: from ``ray.nodes()``);
            a node escalation needs another alive, not-bad node.
    """

    def __init__(self, config: Any, plugin_manager: Any,
                 alive_nodes: Callable[[], set[str]] | None = None) -> None:
        self.max_restarts = int(config.max_restarts)
        self.max_node_failures = int(config.max_node_failures)
        self.pm = plugin_manager
        self._alive_nodes = alive_nodes or _ray_alive_nodes
        self.history: list[Failure] = []
        self.counts: dict[str, int] = {"process": 0, "role": 0, "node": 0, "job": 0}
        self.node_failures: dict[str, int] = {}
        self.bad_nodes: set[str] = set()
        self.last_recovery_end = 0.0
        self._log: list[dict] = []
        self._recovery_s: list[float] = []
        self._t0 = 0.0

    def decide(self, failure: Failure, graph: ComputationGraph) -> RecoveryAction:
        verdict = self.pm.classify_failure(failure, self.history)
        self.history.append(failure)
        level = verdict.level
        if failure.node_id and failure.kind != FailureKind.NODE_LOST and \
                node_attributable(failure, verdict):
            n = self.node_failures[failure.node_id] = self.node_failures.get(failure.node_id, 0) + 1
            if (level in (FailoverLevel.PROCESS, FailoverLevel.ROLE)
                    and n >= self.max_node_failures and self._other_nodes(failure.node_id)):
                level = FailoverLevel.NODE
                verdict = FailureVerdict(FailoverLevel.NODE, f"{n} failures on node {failure.node_id[:12]} "
                                         f"(failover.max_node_failures={self.max_node_failures}); "
                                         "marking it bad", verdict.classifier)
        if level == FailoverLevel.NODE and failure.node_id:
            self.bad_nodes.add(failure.node_id)
        if level != FailoverLevel.FATAL and self.total_restarts() >= self.max_restarts:
            verdict = FailureVerdict(FailoverLevel.FATAL, f"restart budget failover.max_restarts="
                                     f"{self.max_restarts} exhausted ({verdict.reason})",
                                     verdict.classifier)
            level = FailoverLevel.FATAL
        roles = [failure.role] if failure.role and level in (FailoverLevel.PROCESS,
                                                             FailoverLevel.ROLE) else []
        restart_driver, scope = graph_scope(failure, level, roles, graph)
        self._log.append({"ts": time.time(), "role": failure.role, "rank": failure.rank,
                          "kind": failure.kind.value, "exc_type": failure.exc_type,
                          "level": level.value, "reason": verdict.reason, "step": failure.step})
        self._t0 = time.time()
        if level != FailoverLevel.FATAL:
            self.counts[level.value] = self.counts.get(level.value, 0) + 1
        return RecoveryAction(level, verdict, roles, restart_driver, scope)

    def snapshot(self) -> dict:
        """JSON-friendly state, persisted in the JobContext."""
        return {"counts": self.counts, "node_failures": self.node_failures,
                "bad_nodes": sorted(self.bad_nodes), "log": self._log,
                "recovery_s": self._recovery_s,
                "history": [f.as_dict() for f in self.history]}

    def restore(self, snap: dict) -> None:
        """Load :meth:`snapshot` output (after a master restart)."""
        if not snap:
            return
        self.counts.update(snap.get("counts", {}))
        self.node_failures = dict(snap.get("node_failures", {}))
        self.bad_nodes = set(snap.get("bad_nodes", []))
        self._log = list(snap.get("log", []))
        self._recovery_s = list(snap.get("recovery_s", []))
        self.history = [Failure(**f) for f in snap.get("history", [])]

    def _other_nodes(self, node_id: str) -> bool:
        return bool(self._alive_nodes() - self.bad_nodes - {node_id})

    def recovered(self, action: RecoveryAction) -> None:
        self.last_recovery_end = time.time()
        self._recovery_s.append(self.last_recovery_end - self._t0)

    def total_restarts(self) -> int:
        return sum(self.counts.values())

    def restart_counts(self) -> dict[str, int]:
        """``{"total": N, <level>: n, ...}``, the levels from the smallest scope to the
        largest (the order of :class:`FailoverLevel`), whatever order they happened in."""
        order = {lvl.value: i for i, lvl in enumerate(FailoverLevel)}
        levels = sorted(self.counts, key=lambda k: (order.get(k, len(order)), k))
        return {"total": self.total_restarts(), **{k: self.counts[k] for k in levels}}

    def failure_log(self) -> list[dict]:
        return list(self._log)

    def goodput(self, wall_s: float, step_times: dict[int, float]) -> float | None:
        """Productive step time / wall time (DLRover's goodput).

        Productive time = unique steps completed x the median step time, so
        steps redone after a restart, recovery time and start-up are not counted.
        """
        if wall_s <= 0 or len(step_times) < 3:
            return None
        ts = [step_times[s] for s in sorted(step_times)]
        gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
        if not gaps:
            return None
        return round(min(1.0, len(step_times) * statistics.median(gaps) / wall_s), 4)


def _ray_alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
