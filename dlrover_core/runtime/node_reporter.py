"""One step reporter per node: the non-zero ranks of a role hand their newest step
report to their node's agent, which forwards the newest report of every rank it holds
to the JobMaster in one call per interval, so the master's report calls grow with
nodes, not ranks.

- The **agent** (:class:`NodeReporter`) is a named Ray actor per job and node
  (:func:`agent_name`), pinned to the node (``NodeAffinitySchedulingStrategy``, hard),
  not detached: it is owned by the rank that created it (``get_if_exists``: the first
  one) and dies with that rank or with the job. Every ``interval_s`` it sends the
  reports pushed since its last forward, the newest per rank, as one
  ``JobMaster.report_batch`` call and waits for the reply; the master applies each
  entry as it applies a single ``report``, so hang, straggler and progress logic stay
  per rank. A rank that stops (dead, hung) pushes nothing, so nothing of it is
  forwarded: the master sees its reports stop, as without an agent. A forward that
  fails (the master restarts or is gone) keeps its entries for the next one (unless a
  newer report of the rank came meanwhile) and looks the master up by name again.
- A **rank** (:class:`NodeRelay`, used by
  :class:`~dlrover_core.runtime.reporting.StepReporter`) pushes its newest step
  fire-and-forget. Before each push, and once per interval, it checks its pushes: one
  failed (the agent died), the oldest unanswered push waited longer than the relay's
  ``stale_s`` (the agent is stuck or still starting), or the agent answered that its
  forwards have not gone through for longer than ``stale_s`` (the master does not
  answer it) means the rank drops the agent, sends its newest report directly to the
  master, and goes on directly for :data:`RETRY_S` before it looks for (or creates)
  its node's agent again. ``stale_s`` (:func:`relay_stale_s`) is a quarter of the
  hang timeout (at most :data:`PUSH_TIMEOUT_S`), so a slow agent never makes a
  healthy rank look hung. A report the agent acknowledged but had not forwarded when
  it died is replaced by the rank's next step (sent directly); a rank that makes no
  further step after that loses that one report.
- **Re-attach**: a rank's first push to an agent carries its identity (its actor's
  ``node_info``, Ray actor name and handle). The agent names itself and its node in
  every forward, so the master knows which agent serves which node; a restarted
  master asks each known agent once for its node's ranks (:meth:`NodeReporter.roster`:
  identity, newest step, and whether the rank's process still exists) instead of
  probing each rank (:mod:`dlrover_core.master.reattach`).
- Rank 0 of a role and its final report (``StepReporter.flush``/``close``) always go
  directly. Roles of fewer than :func:`min_world` ranks, and ranks alone on their node,
  report directly: an agent process would cost more than it saves.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

#: environment variable: the smallest world size whose ranks report through agents
MIN_WORLD_ENV = "DLROVER_NODE_REPORTER_MIN_WORLD"
DEFAULT_MIN_WORLD = 32
#: without a hang timeout: a push the agent has not answered in this many seconds, or
#: an agent whose forwards have not gone through for as long, counts as lost
PUSH_TIMEOUT_S = 30.0
#: seconds a rank reports directly after its agent failed, before it looks again
RETRY_S = 30.0
#: seconds the agent waits for the master's reply to one forward
FORWARD_TIMEOUT_S = 30.0


def agent_name(job: str, node_id: str) -> str:
    """The Ray actor name of ``job``'s agent on node ``node_id`` (hex)."""
    return f"dlrover-node-reporter:{job}:{node_id}"


def relay_stale_s(interval_s: float, hang_timeout_s: float = 0.0) -> float:
    """Seconds a rank waits on its agent (an unanswered push, forwards that do not go
    through) before it reports directly: :data:`PUSH_TIMEOUT_S`, and with a hang timeout
    (> 0) at most ``max(2 * interval_s, hang_timeout_s / 4)``, so that a rank's report
    reaches the master well within the hang timeout even when its agent is stuck or
    still starting."""
    if hang_timeout_s > 0:
        return min(PUSH_TIMEOUT_S, max(2 * interval_s, hang_timeout_s / 4))
    return PUSH_TIMEOUT_S


def min_world() -> int:
    """The smallest world size whose non-zero ranks use agents (``$DLROVER_NODE_REPORTER_
    MIN_WORLD``, default :data:`DEFAULT_MIN_WORLD`).

    Raises:
        ValueError: the variable is set to something other than an integer >= 1.
    """
    raw = os.environ.get(MIN_WORLD_ENV, "").strip()
    if not raw:
        return DEFAULT_MIN_WORLD
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MIN_WORLD_ENV}={raw!r} is invalid; allowed: an integer >= 1")
    return value


class NodeReporter:
    """The agent of one job on one node (module doc). Made by :func:`get_agent`.

    Args:
        job: the job name (the master is found by name).
        interval_s: seconds between forwards.
        node_id: the node it runs on (hex); its name is ``agent_name(job, node_id)``.
    """

    def __init__(self, job: str, interval_s: float, node_id: str = "") -> None:
        self.job = job
        self.interval_s = interval_s
        self.node_id = node_id
        self.name = agent_name(job, node_id)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], tuple] = {}
        #: (role, rank) -> {"identity": ..., "step": ..., "metrics": ...}: every rank
        #: that pushed with its identity, for :meth:`roster`
        self._ranks: dict[tuple[str, int], dict] = {}
        self._master: Any = None
        #: unix s of the newest forward that went through or had nothing to send
        self._ok_at = time.time()
        self.calls = 0
        self.entries = 0
        self.failed = 0
        threading.Thread(target=self._loop, name="dlrover-node-reporter", daemon=True).start()

    def push(self, role: str, rank: int, step: int, metrics: dict, ts: float,
             identity: dict | None = None) -> float:
        """The newest report of ``role``/``rank`` (``ts``: unix s when the step ended).
        ``identity`` (a rank's first push): ``{"info": its actor's node_info(),
        "actor_name": str, "handle": its actor handle}``. Returns the forward lag (s):
        how long ago a forward last went through or had nothing to send (about one
        interval when the master answers; growing while it does not)."""
        with self._lock:
            old = self._pending.get((role, rank))
            if old is None or step >= old[2]:
                self._pending[(role, rank)] = (role, rank, step, metrics, ts)
            known = self._ranks.get((role, rank))
            if identity is not None:
                known = self._ranks[(role, rank)] = {"identity": identity, "step": -1,
                                                     "metrics": {}}
            if known is not None and step >= known["step"]:
                known["step"], known["metrics"] = step, metrics
        return time.time() - self._ok_at

    def roster(self, node_id: str | None = None) -> list[dict]:
        """The ranks that pushed to this agent with their identity, for a restarted
        master: per rank ``role``, ``rank``, ``actor_name``, ``handle``, ``info`` (its
        ``node_info()``), ``step`` and ``metrics`` (its newest push) and ``alive``
        (its process still exists on this node: ``kill(pid, 0)``). ``node_id``: only
        that node's ranks (all of an agent's ranks are on its node)."""
        with self._lock:
            ranks = list(self._ranks.items())
        out = []
        for (role, rank), known in ranks:
            ident = known["identity"]
            info = ident["info"]
            if node_id is not None and info.get("node_id") != node_id:
                continue
            out.append({"role": role, "rank": rank, "actor_name": ident["actor_name"],
                        "handle": ident["handle"], "info": info, "step": known["step"],
                        "metrics": known["metrics"], "alive": _pid_alive(info["pid"])})
        return out

    def stats(self) -> dict:
        """``calls`` (forwards the master answered), ``entries`` (reports in them),
        ``failed`` (forwards that failed), ``pending`` (reports not forwarded yet)."""
        with self._lock:
            pending = len(self._pending)
        return {"calls": self.calls, "entries": self.entries, "failed": self.failed,
                "pending": pending}

    def forward(self) -> int:
        """Send the pending reports in one ``report_batch`` call now; returns how many
        the master acknowledged (0 when none were pending or the call failed)."""
        import ray

        with self._lock:
            batch, self._pending = self._pending, {}
        if not batch:
            self._ok_at = time.time()
            return 0
        try:
            if self._master is None:
                from dlrover_core.runtime.host_base import master_handle

                self._master = master_handle(self.job)
                if self._master is None:
                    raise LookupError(f"no JobMaster of job {self.job!r} now")
            ray.get(self._master.report_batch.remote(list(batch.values()), self.name,
                                                     self.node_id),
                    timeout=FORWARD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - master restarting or gone: keep, look up again
            self._master = None
            self.failed += 1
            with self._lock:
                for key, entry in batch.items():
                    newer = self._pending.get(key)
                    if newer is None or newer[2] < entry[2]:
                        self._pending[key] = entry
            return 0
        self._ok_at = time.time()
        self.calls += 1
        self.entries += len(batch)
        return len(batch)

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.forward()


def get_agent(job: str, interval_s: float, node_id: str | None = None) -> Any:
    """The handle of ``job``'s agent on ``node_id`` (default: this process's node),
    created there if it does not exist (owned by this process)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dlrover_core.runtime.context import MASTER_NAMESPACE

    node_id = node_id or ray.get_runtime_context().get_node_id()
    return ray.remote(NodeReporter).options(
        name=agent_name(job, node_id), namespace=MASTER_NAMESPACE, get_if_exists=True,
        num_cpus=0, max_restarts=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(job, interval_s, node_id)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this node)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class NodeRelay:
    """One rank's path to its node's agent (module doc).

    Args:
        job, role, rank: who reports.
        interval_s: the agent's forward interval (s), for an agent this rank creates.
        stale_s: seconds after which an unanswered push, or an agent whose forwards have
            not gone through, counts as lost (:func:`relay_stale_s`).
        identity: returns this rank's identity for the agent's roster
            (:meth:`NodeReporter.push`), sent with the first push to each agent;
            ``None``: none is sent (the agent cannot name this rank to a restarted
            master, which then probes the rank itself).
    """

    def __init__(self, job: str, role: str, rank: int, interval_s: float,
                 identity: Any = None, stale_s: float = PUSH_TIMEOUT_S) -> None:
        self.job, self.role, self.rank = job, role, rank
        self.interval_s = interval_s
        self.stale_s = stale_s
        self._identity = identity
        self._introduced = False  # the current agent has this rank's identity
        self._agent: Any = None
        self._retry_at = 0.0
        self._last: Any = None  # the newest push not seen answered yet
        self._waiting_since = 0.0  # unix s of the oldest push not seen answered
        #: why the agent was last dropped ("failed", "unanswered", "lagging"), for tests
        self.dropped: str | None = None

    def push(self, step: int, metrics: dict, ts: float) -> bool:
        """Hand a report to the agent; False when there is none to hand it to (send
        it directly then)."""
        agent = self._agent_or_none()
        if agent is None:
            return False
        ident = None
        if not self._introduced and self._identity is not None:
            try:
                ident = self._identity()
            except Exception:  # noqa: BLE001 - not in an actor: the master probes it
                self._identity = None
        try:
            ref = agent.push.remote(self.role, self.rank, step, metrics, ts, ident)
        except Exception:  # noqa: BLE001 - the handle is unusable
            self._drop("failed")
            return False
        if self._last is None:
            self._waiting_since = time.time()
        self._last = ref  # an actor answers in order: this one answered means all did
        self._introduced = True
        return True

    def lost(self) -> bool:
        """Whether the agent is lost: a push failed, the oldest push not answered yet
        waited more than ``stale_s``, or the agent answered that its forwards have not
        gone through for more than ``stale_s``. A lost agent is dropped and the caller
        sends its newest report directly."""
        ref = self._last
        if ref is None:
            return False
        import ray

        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            self._last = None
            try:
                lag_s = ray.get(ref)
            except Exception:  # noqa: BLE001 - the agent died
                self._drop("failed")
                return True
            if isinstance(lag_s, (int, float)) and lag_s > self.stale_s:
                self._drop("lagging")
                return True
            return False
        if time.time() - self._waiting_since > self.stale_s:
            self._drop("unanswered")
            return True
        return False

    def _agent_or_none(self) -> Any:
        if self._agent is None and time.time() >= self._retry_at:
            try:
                self._agent = get_agent(self.job, self.interval_s)
            except Exception:  # noqa: BLE001 - no agent now: direct for a while
                self._retry_at = time.time() + RETRY_S
        return self._agent

    def _drop(self, why: str) -> None:
        self.dropped = why
        self._agent = self._last = None
        self._introduced = False
        self._retry_at = time.time() + RETRY_S


def node_relay(job: str, role: str, rank: int, world_size: int, local_world_size: int,
               interval_s: float, identity: Any = None,
               hang_timeout_s: float = 0.0) -> NodeRelay | None:
    """The relay of a rank that reports through its node's agent, or ``None`` (rank 0,
    a world smaller than :func:`min_world`, a rank alone on its node). ``identity``:
    see :class:`NodeRelay`; ``hang_timeout_s``: the role's (0: none), which bounds how
    long the rank waits on its agent (:func:`relay_stale_s`)."""
    if rank == 0 or local_world_size < 2 or world_size < min_world():
        return None
    return NodeRelay(job, role, rank, interval_s, identity,
                     relay_stale_s(interval_s, hang_timeout_s))
