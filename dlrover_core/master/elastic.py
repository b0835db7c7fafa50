"""Elastic roles: the world size of a role with ``roles.R.nodes: "MIN:MAX"`` follows the
healthy nodes (torchrun's ``--nnodes=MIN:MAX``; Ray Train v2's ``num_workers=(min, max)``).

- **Shrink** (:meth:`ElasticManager.shrink`): a node of an elastic role is lost. The
  master waits up to ``elastic.replacement_timeout_s`` for the cluster to hold the role
  at its size again (a replacement node), looking every second; then it restarts the
  role alone, at the largest valid world size the nodes can hold (at most its size
  before the loss, at least ``MIN`` nodes; *valid*: ``k * per_node`` ranks that split
  ``elastic.global_batch`` into ``elastic.micro_batch`` micro-batches when those are
  set); a size whose placement cannot be reserved gives way to the next smaller one.
  Its ranks restore from the newest checkpoint (the saver restores into another world
  size; the flash saver from memory). Other roles keep running. The lost room is asked
  back from the cluster (``ray.autoscaler.sdk.request_resources``: a no-op without an
  autoscaler) until the role is back at its size.
- **Grow** (:meth:`ElasticManager.check_grow`): every ``elastic.poll_interval_s`` the
  master looks for room for more node-slots of a role below ``MAX`` nodes; once there
  is room, the role is restarted at the larger size right after its next checkpoint
  (rank 0's next ``checkpoint_saved``). A grow whose placement cannot be reserved then
  is dropped (``elastic_grow_dropped``): the role keeps running at its size.
- **Straggler shrink** (``node_health.straggler_action: shrink``;
  :func:`straggler_shrink_target` before, :meth:`ElasticManager.shrink` after): the
  straggler's node is dropped from its role at once (no replacement wait): the role
  restarts alone at the largest valid size of at most its size less that node's
  ``per_node`` ranks, on the other nodes, from the newest checkpoint. At the role's
  minimum (no valid smaller size) the detector reports instead. The node is kept out
  of the role (its placement, its spares and its grow) for the rest of the job (this
  master's memory: a restarted master forgets it); other roles may still use it.
- **History**: every size the role ran at, with the role's last reported step when it
  changed and the newest checkpoint step the master knew of then (``world_sizes`` in
  ``summary.json``).

Room is counted in *node-slots*: on each alive node not marked bad, how many times what
is free on it (Ray's available resources: less what other roles and other jobs hold)
holds ``per_node`` ranks of the role (its CPU, GPU and memory request), summed over the
nodes, plus the node-slots the role's own placement groups hold on healthy nodes.

A resize first reserves the placement of the new size (:meth:`ElasticManager.resize`:
the role's groups on healthy nodes are kept, the missing ones are made and waited for),
then stops every rank of the role (new processes start at the new world size: a rank's
world size is fixed for its process), removes the groups it did not keep and starts the
ranks; the other roles' placement groups and actors are kept.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from dlrover_core.graph.graph import CollocationGroup
from dlrover_core.master.failover import JobFailed
from dlrover_core.master.elastic_room import (_largest_valid, _pg_table, _remove, _valid,
                                               ask_back, release_spares, reserve_first,
                                               spare_room)
from dlrover_core.master.monitor import alive_nodes
from dlrover_core.placement import ClusterResources
from dlrover_core.plugins.records import FailureKind
from dlrover_core.spec.elastic import NodeRange, node_range

if TYPE_CHECKING:
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.scope import JobScope
    from dlrover_core.master.standby import StandbyPool
    from dlrover_core.plugins.records import Failure

REPLACEMENT_POLL_S = 1.0


class ElasticManager:
    """Shrinks and grows the job's elastic roles (see the module doc).

    Args:
        scope: the job's scope. launcher: places and starts actors. standby: the spares
            (dropped during a resize, made again after).
    """

    def __init__(self, scope: JobScope, launcher: Launcher, standby: StandbyPool) -> None:
        self.scope = scope
        self.launcher = launcher
        self.standby = standby
        self.ranges: dict[str, NodeRange] = {}
        for role in scope.spec.roles:
            rng = node_range(scope.spec, role)
            if rng is not None:
                self.ranges[role] = rng
        e = scope.spec.elastic
        self.replacement_timeout_s = float(e.replacement_timeout_s)
        self.poll_interval_s = float(e.poll_interval_s)
        self.placement_timeout_s = float(e.placement_timeout_s)
        self.global_batch, self.micro_batch = int(e.global_batch), int(e.micro_batch)
        self.history: list[dict] = [
            {"role": role, "world_size": scope.graph.roles[role].total, "step": -1,
             "reason": "start", "checkpoint_step": None}
            for role in self.ranges]
        self._last_poll = 0.0
        self._grow_after: dict[str, int] = {}  # role -> checkpoint step when room appeared
        self._dropped: dict[str, tuple[int, int]] = {}  # role -> (target, node-slots then)
        self._placements = 0  # placement groups made by resizes (their Ray names)
        self._wanted: dict[str, int] = {}  # role -> its size before a lost node
        self._asked: set[str] = set()  # roles with a request_resources in force
        #: role -> nodes kept out of it (a straggler's node, dropped by a shrink); the
        #: standby pool's dict, so that the role's spares keep out of them too
        self.excluded: dict[str, set[str]] = standby.kept_out

    # ------------------------------------------------------------------ sizes
    def valid(self, role: str, world_size: int) -> bool:
        """Whether ``world_size`` ranks is a valid size of ``role``."""
        return _valid(self.ranges[role], world_size, self.global_batch, self.micro_batch)

    def largest_valid(self, role: str, node_slots: int) -> int | None:
        """The largest valid world size on at most ``node_slots`` node-slots, or ``None``."""
        return _largest_valid(self.ranges[role], node_slots, self.global_batch,
                              self.micro_batch)

    def node_slots(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> int:
        """How many node-slots of ``role`` (``per_node`` ranks each) it could run on now:
        on each alive node not marked bad (nor in ``exclude``), how many times what is
        free there (Ray's available resources) and what the groups no rank runs in hold
        there (:func:`~dlrover_core.master.elastic_room.spare_room`: a resize removes
        them first) holds ``per_node`` ranks, plus the node-slots the role's own
        placement groups hold on such nodes (a resize keeps them)."""
        need = self._slot_need(role)
        skip = self._skip(role, exclude)
        spare = spare_room(self, role, skip)
        slots = 0
        for node in ClusterResources.from_ray(exclude=skip, available=True).nodes:
            extra = spare.get(node.node_id, {})
            slots += int(min((node.resources.get(k, 0.0) + extra.get(k, 0.0)) / v + 1e-9
                             for k, v in need.items()))
        return slots + len(self._own_slots(role, skip)) // self.ranges[role].per_node

    def _slot_need(self, role: str) -> dict[str, float]:
        r = self.scope.graph.roles[role]
        need = {k: v * r.per_node for k, v in r.resources.as_ray().items() if v > 0}
        return need or {"CPU": 0.001 * r.per_node}

    def _skip(self, role: str, exclude: frozenset[str] | set[str] = frozenset()) -> set[str]:
        return set(self.scope.failover.bad_nodes) | set(exclude) | \
            self.excluded.get(role, set())

    def _own_slots(self, role: str, skip: set[str]) -> dict[int, Any]:
        """rank -> placement group of ``role``'s current ranks whose bundle is ready on an
        alive node outside ``skip`` (the placement a resize can keep)."""
        la = self.launcher
        if la.plan is None:
            return {}
        alive = alive_nodes()
        out: dict[int, Any] = {}
        tables: dict[int, dict] = {}
        for (r, rank), slot in la.plan.slots.items():
            if r != role or slot.pg >= len(la.pgs):
                continue
            if slot.pg not in tables:
                tables[slot.pg] = _pg_table(la.pgs[slot.pg])
            t = tables[slot.pg]
            node = (t.get("bundles_to_node_id") or {}).get(slot.bundle)
            if t.get("state") == "CREATED" and node in alive and node not in skip:
                out[rank] = la.pgs[slot.pg]
        return out

    # ------------------------------------------------------------------ shrink
    def handles(self, failure: Failure) -> bool:
        """Whether this manager recovers ``failure``: a failure of an elastic role while
        one of its nodes is lost (the lost rank's ``node_lost``, or a survivor whose
        collective broke first)."""
        if failure.role not in self.ranges:
            return False
        if failure.kind == FailureKind.STRAGGLER:
            return str(self.scope.spec.node_health.straggler_action) == "shrink"
        return failure.kind == FailureKind.NODE_LOST or bool(self.lost_nodes(failure.role))

    def lost_nodes(self, role: str) -> list[str]:
        """Nodes of ``role``'s instances that are no longer alive."""
        alive = alive_nodes()
        return sorted({i.node_id for (r, _), i in self.scope.instances.roles.items()
                       if r == role and i.node_id and i.node_id not in alive})

    def shrink(self, failure: Failure) -> dict[str, Any]:
        """Recover ``failure`` (a lost node of an elastic role): wait for a replacement,
        then restart the role at the largest valid size. Returns the phase timings (s).

        Raises:
            JobFailed: fewer than ``MIN`` nodes' worth of room is left.
            InstanceFailure: a new rank failed to start.
            JobStopped: the job was stopped while waiting.
        """
        s, role = self.scope, failure.role
        if failure.kind == FailureKind.STRAGGLER:
            return self._drop_straggler(failure)
        # Ray may list a lost node as alive for a moment: never count it as room
        lost = sorted(set(self.lost_nodes(role)) | ({failure.node_id} if
                      failure.kind == FailureKind.NODE_LOST and failure.node_id else set()))
        current = s.graph.roles[role].total
        per_node = self.ranges[role].per_node
        t0 = time.time()
        deadline = t0 + self.replacement_timeout_s
        while True:
            s.check_stop()
            slots = self.node_slots(role, exclude=set(lost))
            if slots * per_node >= current or time.time() >= deadline:
                break
            time.sleep(min(REPLACEMENT_POLL_S, max(0.0, deadline - time.time())))
        waited = round(time.time() - t0, 3)
        target = self.largest_valid(role, min(slots, current // per_node))
        if target is None:
            rng = self.ranges[role]
            raise JobFailed(
                f"role {role!r} lost node(s) {', '.join(n[:12] for n in lost)} and no "
                "replacement came within "
                f"elastic.replacement_timeout_s={self.replacement_timeout_s:g}: the cluster holds "
                f"{slots} node-slot(s) of {per_node} rank(s), fewer than roles.{role}.nodes "
                f"minimum {rng.min_nodes} (or no size in {rng.min_nodes}..{rng.max_nodes} nodes "
                "splits elastic.global_batch)")
        reason = "replaced" if target >= current else "shrink"
        self._wanted[role] = max(self._wanted.get(role, 0), current)
        phases = self.resize(role, target, reason, exclude=set(lost))
        return {"replacement_wait_s": waited, **(phases or {})}

    def _drop_straggler(self, failure: Failure) -> dict[str, Any]:
        """Drop the straggler's node from its role: restart the role at the largest
        valid size of at most its size less one node, on its other nodes; keep the node
        out of the role from now on. Returns the phase timings (s).

        Raises:
            JobFailed: no valid smaller size fits on the other nodes (the detector
                checked the sizes before; the nodes left may hold fewer slots).
            InstanceFailure: a new rank failed to start.
        """
        role, node = failure.role, failure.node_id
        if node:
            self.excluded.setdefault(role, set()).add(node)
        current = self.scope.graph.roles[role].total
        per_node = self.ranges[role].per_node
        slots = self.node_slots(role)
        target = self.largest_valid(role, min(slots, current // per_node - 1))
        if target is None:
            raise JobFailed(
                f"role {role!r}: no valid world size below {current} fits on its nodes "
                f"without straggler node {node[:12]} ({slots} node-slot(s) left)")
        return {"straggler_node": node, **(self.resize(role, target, "straggler") or {})}

    # ------------------------------------------------------------------ grow
    def check_grow(self) -> None:
        """Called by the controller while ``RUNNING``: look for room every
        ``elastic.poll_interval_s``; grow a role right after its next checkpoint. A grow
        whose placement cannot be reserved is dropped (:meth:`resize`); the same target
        is not tried again until the room counted changes.

        Raises:
            InstanceFailure: a new rank failed to start.
        """
        s = self.scope
        now = time.time()
        for role in self.ranges:
            total = s.graph.roles[role].total
            if role in self._grow_after:
                ck = s.checkpoint_steps.get(role)
                if ck is None or ck <= self._grow_after[role]:
                    continue
                del self._grow_after[role]
                slots = self.node_slots(role)
                target = self.largest_valid(role, slots)
                if target is not None and target > total:
                    self.resize(role, target, "grow")
                else:  # taken by someone else since it was counted
                    self._dropped[role] = (target, slots)
                    s.emit("elastic_grow_dropped", role=role, world_size=total, target=None,
                           reason=f"the room seen is gone: {slots} node-slot(s) free or "
                           "held by the role now")
                continue
            if now - self._last_poll < self.poll_interval_s or \
                    total >= self.ranges[role].max_ranks:
                continue
            slots = self.node_slots(role)
            target = self.largest_valid(role, slots)
            if self._dropped.get(role) == (target, slots):
                continue  # dropped at this room before: wait for the room to change
            if target is not None and target > total:  # node_slots skips excluded nodes
                self._grow_after[role] = s.checkpoint_steps.get(role, -1)
                s.emit("elastic_room", role=role, world_size=total, target=target,
                       after_checkpoint=self._grow_after[role])
        if now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now

    # ------------------------------------------------------------------ resize
    def sizes_down(self, role: str, world_size: int, floor: int | None = None) -> list[int]:
        """The valid sizes of ``role`` from ``world_size`` down to ``floor`` ranks
        (default: its minimum), largest first."""
        rng = self.ranges[role]
        lo = rng.min_ranks if floor is None else max(floor, rng.min_ranks)
        return [w for w in range(world_size, lo - 1, -rng.per_node) if self.valid(role, w)]

    def resize(self, role: str, world_size: int, reason: str,
               exclude: set[str] = frozenset(),  # type: ignore[assignment]
               ) -> dict[str, Any] | None:
        """Restart ``role`` alone at ``world_size`` ranks (new processes, rendezvous,
        ``setup()``); record it in :attr:`history` and emit ``elastic_resized``.

        The placement of the new size is reserved before any rank is stopped: the role's
        placement groups on healthy nodes (alive, not bad, not in ``exclude`` nor kept
        out of the role) are kept, the missing ones are made and must be ready within
        ``elastic.placement_timeout_s``. First the spares are killed and the groups no
        rank runs in removed (:func:`~.elastic_room.release_spares`: :meth:`node_slots`
        counted their room). A grow (``world_size`` above the current size) that cannot
        be reserved tries the smaller grows; when none fits it is dropped: no rank is
        stopped, an ``elastic_grow_dropped`` event says why, a new spare is made, and
        this returns ``None``. Any other resize that cannot be reserved tries the next
        smaller valid sizes down to ``MIN``, first with the ranks running, then (a group
        of the whole role holds the survivors' resources) after stopping them.

        Returns:
            the phase timings (s) and the ``world_size`` reached, or ``None`` (a grow
            dropped).
        Raises:
            JobFailed: not even ``MIN`` nodes' worth of the role could be placed (only
                a shrink; the role's ranks are stopped).
            InstanceFailure: a new rank failed to start.
        """
        s = self.scope
        t0 = time.time()
        old = s.graph.roles[role].total
        skip = self._skip(role, exclude)
        if world_size > old:
            sizes = self.sizes_down(role, world_size, old + 1)
        else:
            sizes = self.sizes_down(role, world_size)
        members = [i for (r, _), i in s.instances.roles.items() if r == role]
        last_step = max((i.last_step for i in members), default=-1)
        attempts = {(role, i.rank): i.attempt + 1 for i in members}
        tried: list[str] = []
        release_spares(self, role)  # the spares may hold room the new size counted on
        got = reserve_first(self, role, sizes, skip, tried)
        if got is None and world_size > old:
            self._dropped[role] = (world_size, self.node_slots(role))
            s.emit("elastic_grow_dropped", role=role, world_size=old, target=world_size,
                   reason="; ".join(tried) or "no valid size above the current one")
            self.standby.ensure()
            return None
        t_placed = time.time()
        self.launcher.stop_instances(members)
        t_stop = time.time()
        if got is None:
            # the role's own groups may hold what the smaller sizes need: stop first
            self._remove_own(role)
            got = reserve_first(self, role, sizes, skip, tried)
            if got is None:
                rng = self.ranges[role]
                raise JobFailed(
                    f"role {role!r} could not be placed at any valid size from "
                    f"{world_size} down to roles.{role}.nodes minimum {rng.min_nodes} "
                    f"node(s) of {rng.per_node}: " + "; ".join(tried))
        size, plan, pgs, unused = got
        for pg in unused:
            _remove(pg)
        for inst in members:
            if inst.rank >= size:
                del s.instances.roles[(role, inst.rank)]
        self._commit(role, size, plan, pgs)
        t_commit = time.time()
        attempts = {(role, k): attempts.get((role, k), 0) for k in range(size)}
        self.launcher.start_roles([role], attempts)
        self.standby.ensure()
        if size != world_size:
            reason = f"{reason} (placed at {size} of {world_size})"
        entry = {"role": role, "world_size": size, "step": last_step, "reason": reason,
                 "checkpoint_step": s.checkpoint_steps.get(role)}
        self.history.append(entry)
        s.context.set("world_sizes", self.history)
        s.emit("elastic_resized", previous=old, **entry)
        ask_back(self, role, size)
        return {"place_s": round(t_placed - t0, 3), "stop_s": round(t_stop - t_placed, 3),
                "start_s": round(time.time() - t_commit, 3), "world_size": size,
                **self.launcher.phases}

    def _remove_own(self, role: str) -> None:
        """Remove ``role``'s placement groups (its ranks are stopped); a removed group is
        no longer ``CREATED``, so :func:`~dlrover_core.master.elastic_room.reserve` keeps none of them."""
        la = self.launcher
        for g, pg in zip(la.plan.groups, la.pgs):
            if g.name.split(":")[0] == role:
                _remove(pg)

    def _commit(self, role: str, size: int, plan: Any, pgs: list[Any]) -> None:
        """The reserved placement becomes the job's; the spares' groups are removed."""
        la = self.launcher
        for pg in la.pgs[len(la.plan.groups):]:  # spares' groups
            _remove(pg)
        self._set_total(role, size)
        la.plan, la.pgs = plan, pgs
        self.standby.forget_slots()
        self.scope.emit("placement", policy=self.scope.spec.placement, groups=plan.describe(),
                        excluded_nodes=sorted(self.scope.failover.bad_nodes), role=role,
                        straggler_nodes=sorted(self.excluded.get(role, set())))

    def _set_total(self, role: str, total: int) -> None:
        g = self.scope.graph
        g.roles[role] = dataclasses.replace(g.roles[role], total=total)
        g.groups = [CollocationGroup(grp.roles, total, grp.per_node) if grp.roles == (role,)
                    else grp for grp in g.groups]
