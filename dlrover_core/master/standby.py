"""The standby pool: one warm spare ``WorkloadHost`` per role with a process group
(``failover.standby: true``). A spare imports the workload and runs its ``warm_up()``
ahead of time; a process-level recovery promotes it (:meth:`StandbyPool.take`)
instead of starting a cold process.

A spare made after a promotion (a refill: the ranks are training) warms up at the
lowest CPU priority (``SCHED_IDLE``, for 30 s at most:
:func:`dlrover_core.runtime.warming.low_priority`), so that it takes only the CPU the
ranks sharing its cores leave idle; a promotion that finds it still warming raises it
back first (``hurry()``). A role's first spare warms at normal priority, so that it is
warm within seconds of the job's start (a kill after step 20 of the 2-core demo found an
idle-priority first spare still warming and took 1.3-1.7 s instead of 0.7 s). The pool
emits ``standby_ready`` (with ``prepare_s``) when a spare is warm.

A spare holds a reservation like a rank's: one placement-group bundle with the rank's
resources (CPU, GPU, memory), and the actor asks for them, so a promoted spare runs with
its GPU visible and its CPUs counted. The first spare of a role gets a placement group
of its own (one bundle, ``STRICT_PACK``, bad nodes and the role's straggler nodes kept
out); on promotion the rank moves to the spare's bundle and the failed rank's bundle
becomes the next spare's. When
the cluster has no room for the spare's bundle, the spare waits (it is not warm) and a
failed rank is replaced by a fresh actor in its own bundle, as without a standby. A
role whose ranks ask for no resources gets a spare without a bundle.

A GPU role on a cluster with no free GPU (one GPU node, its GPU held by the rank) gets
a **GPU-less spare**: no bundle, no reservation, every GPU of the node visible
(``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``); it warms up without a GPU (imports,
``warm_up()``, which must not touch CUDA). Promoted, it takes a lease on the failed
rank's bundle (:class:`dlrover_core.runtime.host.ResourceLease`: an actor owned by the
spare's process, holding the bundle's CPU and GPU), computes on the GPU the lease got
from Ray, and the rank keeps its bundle; the lease dies with the process, so the
bundle is free again for whatever replaces it next.

The pool watches its spares (one pending ``wait_stopped()`` each): a spare that dies
is noticed by :meth:`StandbyPool.check` (``standby_died``) and replaced. Spare names are
kept in the JobContext (``standbys``) so that a restarted master can kill the old ones.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlrover_core.master.instances import InstanceState
from dlrover_core.master.launcher import kill_actor
from dlrover_core.master.monitor import alive_nodes
from dlrover_core.runtime.context import MASTER_NAMESPACE
from dlrover_core.runtime.devices import actor_env
from dlrover_core.runtime.host import LEASE_WAIT_S, remote_workload_host

#: s a promotion waits for a spare's answer to a ping (its process runs)
PING_S = 2.0
#: s a promotion waits for a running spare still in ``prepare()`` (imports and
#: ``warm_up()``); past it the spare is replaced by a fresh process
PREPARE_WAIT_S = 15.0
#: s at most that the next spare of a role waits after a promotion for the promoted
#: rank's first step report (see :meth:`StandbyPool.take`)
REFILL_WAIT_S = 30.0

if TYPE_CHECKING:
    from dlrover_core.master.instances import Instance
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.scope import JobScope
    from dlrover_core.placement import InstanceSlot


@dataclass
class Spare:
    """One warm spare: its actor, the ref of its ``prepare()``, its name, the slot
    (placement group index in ``Launcher.pgs``, bundle) it reserves (``None``: no
    bundle), and the ref of its ``wait_stopped()`` (ready once it dies)."""

    handle: Any
    prepared: Any
    name: str
    slot: InstanceSlot | None
    watch: Any
    #: warms up without a GPU and leases the failed rank's bundle when promoted
    gpu_less: bool = False
    #: ``standby_ready`` was emitted (its ``prepare()`` returned)
    announced: bool = False


class StandbyPool:
    """Warm spares by role, and the free bundles they may use (``free_slots``)."""

    def __init__(self, scope: JobScope, launcher: Launcher) -> None:
        self.scope = scope
        self.launcher = launcher
        self.spares: dict[str, Spare] = {}
        #: role -> a bundle of the role's size that nothing runs in (a promoted spare
        #: left it, or a spare died there); the next spare goes there
        self.free_slots: dict[str, InstanceSlot] = {}
        #: role -> nodes the role's new spares keep out of, besides the bad nodes (the
        #: elastic manager's straggler nodes: ``ElasticManager.excluded`` is this dict)
        self.kept_out: dict[str, set[str]] = {}
        #: role -> (the promoted instance, monotonic deadline): its next spare waits
        self.refill_after: dict[str, tuple[Instance, float]] = {}
        #: roles a spare of which was promoted: their next spares warm at idle priority
        self.refilled: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.scope.spec.failover.standby)

    def _persist(self) -> None:
        self.scope.context.set("standbys", [sp.name for sp in self.spares.values()])

    def ensure(self) -> None:
        """Create a spare for every role with a process group that has none."""
        if not self.enabled:
            return
        s = self.scope
        for role, r in s.graph.roles.items():
            if not r.backend or role in self.spares or self._refill_waits(role):
                continue
            if s.instances.roles.get((role, 0)) is None or self.launcher.plan is None:
                continue
            slot = self.free_slots.pop(role, None)
            gpu_less = slot is None and self._no_free_gpu(role)
            if slot is None and not gpu_less:
                slot = self._new_slot(role)
            # unique across master restarts: an earlier master's standby may still hold
            # an older name until the re-attach kills it
            name = f"dlrover-{s.name}-{role}-standby-{uuid.uuid4().hex[:8]}"
            gpu = self.launcher.plan.slots[(role, 0)].resources.get("GPU", 0.0) if gpu_less \
                else (slot.resources.get("GPU", 0.0) if slot else 0.0)
            env = {**dict(r.env), "OMP_NUM_THREADS": str(max(1, int(r.resources.cpu))),
                   **self.launcher.device_env(role, gpu)}
            if gpu_less:  # must see the node's GPUs once promoted, whatever the mode
                env.update(actor_env(gpu, ray_auto_visible_device=False))
            opts: dict[str, Any] = {"name": name, "namespace": MASTER_NAMESPACE,
                                    "max_restarts": 0, "lifetime": "detached",
                                    "runtime_env": {"env_vars": env}, "num_cpus": 0}
            if slot is not None:
                opts.update(num_cpus=slot.resources.get("CPU", 0.0),
                            num_gpus=slot.resources.get("GPU", 0.0),
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                placement_group=self.launcher.pgs[slot.pg],
                                placement_group_bundle_index=slot.bundle))
                if slot.resources.get("memory"):
                    opts["memory"] = slot.resources["memory"]
            handle = remote_workload_host().options(**opts).remote(
                r.workload, self.launcher.worker_context(role, 0, 0))
            # a refill warms at idle priority (beside ranks that train); the first spare
            # of a role at normal priority: warm within seconds, for an early failure
            self.spares[role] = Spare(handle, handle.prepare.remote(role in self.refilled),
                                      name, slot, handle.wait_stopped.remote(), gpu_less)
            s.emit("standby_created", role=role, actor=name, gpu_less=gpu_less,
                   kept_out=sorted(self.kept_out.get(role, set())))
        self._persist()

    def _refill_waits(self, role: str) -> bool:
        """Whether the role's next spare still waits for its promoted rank: until that
        instance reported a step (or ended), at most :data:`REFILL_WAIT_S`."""
        entry = self.refill_after.get(role)
        if entry is None:
            return False
        inst, deadline = entry
        if (not inst.reported and time.monotonic() < deadline
                and inst.state in (InstanceState.STARTING, InstanceState.RUNNING)):
            return True
        del self.refill_after[role]
        return False

    def _no_free_gpu(self, role: str) -> bool:
        """Whether a rank of ``role`` asks for GPUs and the cluster has fewer free
        (``ray.available_resources()``) than one rank asks for."""
        need = self.launcher.plan.slots[(role, 0)].resources.get("GPU", 0.0)
        return bool(need) and ray.available_resources().get("GPU", 0.0) < need

    def _new_slot(self, role: str) -> InstanceSlot | None:
        """A placement group of one bundle with the resources of one rank of ``role``
        (``None`` when a rank asks for none), kept off the bad nodes and the role's
        :attr:`kept_out` nodes."""
        base = self.launcher.plan.slots[(role, 0)]
        bundle = {k: v for k, v in base.resources.items() if v}
        if not bundle:
            return None
        kwargs: dict[str, Any] = {}
        kept = self.kept_out.get(role)
        bad = sorted(set(self.launcher.alive_bad_nodes()) | (kept & alive_nodes() if kept
                                                            else set()))
        if bad:
            kwargs["bundle_label_selector"] = [{"ray.io/node-id": f"!in({','.join(bad)})"}]
        pg = placement_group([bundle], strategy="STRICT_PACK", lifetime="detached",
                             name=self.launcher.pg_name(f"{role}-spare-{uuid.uuid4().hex[:6]}"),
                             **kwargs)
        self.launcher.pgs.append(pg)
        return replace(base, pg=len(self.launcher.pgs) - 1, bundle=0)

    def take(self, role: str, rank: int, attempt: int) -> Instance | None:
        """Promote the role's spare to ``rank`` if it is alive and warm, or running and
        warm within :data:`PREPARE_WAIT_S`; ``None`` (and a ``standby_unusable`` event)
        otherwise (dead, not started, or its ``prepare()`` failed or is too slow). The
        rank moves to the spare's bundle; its old bundle (the failed actor was stopped)
        is the next spare's. The next spare is made once the promoted rank has reported
        a step (or after :data:`REFILL_WAIT_S`): its process start (imports, warm-ups:
        seconds of CPU) would otherwise compete with the recovery's first step on the
        rank's node (on 2 cores the steps right after a promotion took 0.75-1.1 s
        against 0.48 s while it started)."""
        s = self.scope
        spare = self.spares.pop(role, None)
        self._persist()
        if spare is None:
            s.emit("standby_unusable", role=role, reason="none")
            return None
        no_room = None
        try:
            if not ray.wait([spare.prepared], timeout=0)[0]:
                no_room = self._no_room(spare)  # given up at once: it would never start
                if no_room is not None:
                    raise RuntimeError(no_room)
            if not ray.wait([spare.prepared], timeout=0.5)[0]:
                # still warming up: a spare whose process runs (it answers) finishes
                # its imports sooner than a fresh process would repeat them, at full CPU
                # priority from now (a refill warms at the lowest); one that does not
                # answer is given up
                ray.get(spare.handle.hurry.remote(), timeout=PING_S)
                ray.wait([spare.prepared], timeout=PREPARE_WAIT_S)
            ray.get(spare.prepared, timeout=0)
            lease = None
            if spare.gpu_less:  # take the failed rank's bundle (its actor was stopped)
                slot = self.launcher.plan.slots[(role, rank)]
                lease = {"placement_group": self.launcher.pgs[slot.pg],
                         "bundle_index": slot.bundle, "resources": dict(slot.resources)}
            ray.get(spare.handle.assign.remote(
                self.launcher.worker_context(role, rank, attempt), lease),
                timeout=5 + (LEASE_WAIT_S if lease else 0))
        except Exception as exc:  # noqa: BLE001 - not warm yet, or dead: start a fresh one
            s.emit("standby_unusable", role=role, actor=spare.name,
                   reason=no_room or f"{type(exc).__name__}: {str(exc)[:300]}")
            kill_actor(spare.handle)
            if spare.slot is not None:
                self.free_slots[role] = spare.slot
            return None
        if spare.slot is not None and not spare.gpu_less:
            slots = self.launcher.plan.slots
            self.free_slots[role] = slots[(role, rank)]
            slots[(role, rank)] = spare.slot
        inst = s.instances.register(role, rank, spare.handle, spare.name, attempt)
        self.refill_after[role] = (inst, time.monotonic() + REFILL_WAIT_S)
        self.refilled.add(role)
        return inst

    def _no_room(self, spare: Spare) -> str | None:
        """Why a spare that is not warm will never start, when its bundle was never placed
        (the cluster has no room for one more rank beside the ranks): :meth:`take` gives
        it up at once with this as the reason of ``standby_unusable``, instead of pinging
        it for :data:`PING_S` (2.5 s of a recovery on the 2-core demo). ``None``: its
        placement group was placed, or it has no bundle."""
        if spare.slot is None:
            return None
        from ray.util import placement_group_table

        pg = self.launcher.pgs[spare.slot.pg]
        if placement_group_table(pg).get("state") != "PENDING":
            return None
        bundle = {k: v for k, v in spare.slot.resources.items() if v}
        return (f"never started: no room for its bundle {bundle} beside the ranks (its "
                "placement group is still PENDING); give the cluster one rank's resources "
                "more, or set failover.standby=false")

    def check(self) -> None:
        """Notice spares that died (``standby_died``) and replace them; make the spares
        that waited for a promoted rank's first step."""
        if [r for r in list(self.refill_after) if not self._refill_waits(r)]:
            self.ensure()  # (not on every poll while one waits: ensure() persists)
        if not self.spares:
            return
        self._announce_ready()
        watches = {sp.watch: role for role, sp in self.spares.items()}
        ready, _ = ray.wait(list(watches), num_returns=len(watches), timeout=0)
        if not ready:
            return
        for ref in ready:
            role = watches[ref]
            spare = self.spares.pop(role)
            try:
                ray.get(ref)
                reason = "stopped"
            except Exception as exc:  # noqa: BLE001 - the usual case: the actor died
                reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            self.scope.emit("standby_died", role=role, actor=spare.name, reason=reason)
            kill_actor(spare.handle)
            if spare.slot is not None:
                self.free_slots[role] = spare.slot
        self.ensure()

    def _announce_ready(self) -> None:
        """Emit ``standby_ready`` (``role``, ``actor``, ``prepare_s``: the seconds its
        ``prepare()`` took, at low priority where it could) once per spare whose
        ``prepare()`` returned; one that raised is left to :meth:`take` and :meth:`check`."""
        pending = {sp.prepared: (role, sp) for role, sp in self.spares.items()
                   if not sp.announced}
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in ready:
            role, sp = pending[ref]
            sp.announced = True
            try:
                seconds = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - failed or died: take()/check() say why
                continue
            self.scope.emit("standby_ready", role=role, actor=sp.name,
                            prepare_s=round(float(seconds), 3))

    def warm(self) -> dict[str, bool]:
        """role -> whether its spare finished ``prepare()`` without an error (for
        ``status()``): a spare that died (killed, or its ``prepare()`` raised) is not
        warm, though its ``prepared`` ref is ready until :meth:`check` notices it."""
        out = {}
        for role, sp in list(self.spares.items()):
            try:  # as take() checks: ready and returned (not ready: GetTimeoutError)
                ray.get(sp.prepared, timeout=0)
                out[role] = True
            except Exception:  # noqa: BLE001 - still preparing, dead or failed: not warm
                out[role] = False
        return out

    def drop(self) -> None:
        """Kill every spare (their bundles stay free for the next ones)."""
        for role, sp in self.spares.items():
            kill_actor(sp.handle)
            if sp.slot is not None:
                self.free_slots.setdefault(role, sp.slot)
        self.spares.clear()
        self._persist()

    def forget_slots(self) -> None:
        """The placement groups were made again: the free bundles are gone."""
        self.free_slots.clear()

    def kill_previous(self, names: list[str]) -> None:
        """Re-attach: kill the spares an earlier master left (by name)."""
        for name in names:
            try:
                kill_actor(ray.get_actor(name, namespace=MASTER_NAMESPACE))
            except ValueError:
                pass
        self._persist()
