"""The standby pool: one warm spare ``WorkloadHost`` per role with a process group
(``failover.standby: true``). A spare imports the workload and runs its ``warm_up()``
ahead of time; a process-level recovery promotes it (:meth:`StandbyPool.take`)
instead of starting a cold process. Spare names are kept in the JobContext
(``standbys``) so that a restarted master can kill the old ones.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import ray

from dlrover_core.master.launcher import kill_actor
from dlrover_core.runtime.context import MASTER_NAMESPACE
from dlrover_core.runtime.host import remote_workload_host

if TYPE_CHECKING:
    from dlrover_core.master.instances import Instance
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.scope import JobScope


class StandbyPool:
    """Warm spares by role: ``role -> (handle, ref of prepare(), actor name)``."""

    def __init__(self, scope: JobScope, launcher: Launcher) -> None:
        self.scope = scope
        self.launcher = launcher
        self.spares: dict[str, tuple[Any, Any, str]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.scope.spec.failover.standby)

    def _persist(self) -> None:
        self.scope.context.set("standbys", [name for _, _, name in self.spares.values()])

    def ensure(self) -> None:
        """Create a spare for every role with a process group that has none, on the node
        of the role's rank 0, holding no resources until it is promoted."""
        if not self.enabled:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s = self.scope
        for role, r in s.graph.roles.items():
            if not r.backend or role in self.spares:
                continue
            rank0 = s.instances.roles.get((role, 0))
            if rank0 is None or not rank0.node_id:
                continue
            # unique across master restarts: an earlier master's standby may still hold
            # an older name until the re-attach kills it
            name = f"dlrover-{s.name}-{role}-standby-{uuid.uuid4().hex[:8]}"
            env = {**dict(r.env), "OMP_NUM_THREADS": str(max(1, int(r.resources.cpu)))}
            handle = remote_workload_host().options(
                name=name, namespace=MASTER_NAMESPACE, num_cpus=0, max_restarts=0,
                lifetime="detached", runtime_env={"env_vars": env},
                scheduling_strategy=NodeAffinitySchedulingStrategy(rank0.node_id, soft=True),
            ).remote(r.workload, self.launcher.worker_context(role, 0, 0))
            self.spares[role] = (handle, handle.prepare.remote(), name)
        self._persist()

    def take(self, role: str, rank: int, attempt: int) -> Instance | None:
        """Promote the role's spare to ``rank`` if it is warm and alive; ``None`` (and a
        ``standby_unusable`` event) otherwise."""
        s = self.scope
        entry = self.spares.pop(role, None)
        self._persist()
        if entry is None:
            s.emit("standby_unusable", role=role, reason="none")
            return None
        handle, prepared, name = entry
        try:
            ray.get(prepared, timeout=0.5)
            ray.get(handle.assign.remote(self.launcher.worker_context(role, rank, attempt)),
                    timeout=5)
        except Exception as exc:  # noqa: BLE001 - not warm yet, or dead: start a fresh one
            s.emit("standby_unusable", role=role, actor=name,
                   reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            kill_actor(handle)
            return None
        return s.instances.register(role, rank, handle, name, attempt)

    def warm(self) -> dict[str, bool]:
        """role -> whether its spare finished ``prepare()`` (for ``status()``)."""
        return {role: bool(ray.wait([ref], timeout=0)[0])
                for role, (_, ref, _) in list(self.spares.items())}

    def drop(self) -> None:
        """Kill every spare."""
        for handle, _, _ in self.spares.values():
            kill_actor(handle)
        self.spares.clear()
        self._persist()

    def kill_previous(self, names: list[str]) -> None:
        """Re-attach: kill the spares an earlier master left (by name)."""
        for name in names:
            try:
                kill_actor(ray.get_actor(name, namespace=MASTER_NAMESPACE))
            except ValueError:
                pass
        self._persist()
