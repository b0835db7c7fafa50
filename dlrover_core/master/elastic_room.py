"""Room for an elastic role's resize (:mod:`dlrover_core.master.elastic`): which world
sizes are valid (:func:`_valid`: ``k * per_node`` ranks that split ``elastic.global_batch``
into ``elastic.micro_batch`` micro-batches when those are set), the reservation of a new
size's placement before any rank stops (:func:`reserve`, :func:`reserve_first`), the
room the standby spares hold and its release before a resize (:func:`spare_room`,
:func:`release_spares`), asking the cluster for room a role lost (:func:`ask_back`) and
the target of a straggler shrink.
The functions that take ``mgr`` work on an ``ElasticManager``'s state (its launcher,
scope, ranges and requests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.util.placement_group import remove_placement_group

from dlrover_core.master.launcher import create_placement_groups
from dlrover_core.master.monitor import alive_nodes
from dlrover_core.placement import PlacementError
from dlrover_core.spec.elastic import NodeRange, node_range

if TYPE_CHECKING:
    from dlrover_core.master.scope import JobScope


def reserve_first(mgr: Any, role: str, sizes: list[int], skip: set[str],
                   tried: list[str]) -> tuple | None:
    """The first of ``sizes`` whose placement could be reserved (:func:`reserve`),
    or ``None``; each failure's reason is appended to ``tried``."""
    for size in sizes:
        try:
            return (size, *reserve(mgr, role, size, skip))
        except PlacementError as exc:
            tried.append(f"{size} rank(s): {exc}")
            mgr.scope.emit("elastic_placement_failed", role=role, world_size=size,
                            reason=str(exc))
    return None


def reserve(mgr: Any, role: str, size: int, skip: set[str]) -> tuple:
    """Plan the job with ``role`` at ``size`` ranks and hold that placement: the other
    roles' groups (by name) and ``role``'s groups whose every bundle is on a healthy
    node (matched by bundles and strategy) are kept, the others are made now and
    waited for (``elastic.placement_timeout_s``). Changes nothing when it raises.
    Returns ``(plan, pgs in plan order, role's old groups not kept)``.

    Raises:
        PlacementError: the plan does not fit, or a new group was not ready in time
            (the ones made are removed again).
    """
    la, s = mgr.launcher, mgr.scope
    old_total = s.graph.roles[role].total
    mgr._set_total(role, size)
    try:
        plan = la.make_plan()
    finally:
        mgr._set_total(role, old_total)
    old_plan, old_pgs = la.plan, list(la.pgs)
    by_name = {g.name: pg for g, pg in zip(old_plan.groups, old_pgs)}
    mine = [i for i, g in enumerate(old_plan.groups) if g.name.split(":")[0] == role]
    own = mgr._own_slots(role, skip)
    healthy = []  # (plan group, pg): every one of its ranks' bundles is healthy
    for i in mine:
        ranks = [rk for (r, rk), sl in old_plan.slots.items() if r == role and sl.pg == i]
        if ranks and all(rk in own for rk in ranks):
            healthy.append((old_plan.groups[i], old_pgs[i]))
    pgs: dict[int, Any] = {}
    for i, g in enumerate(plan.groups):
        if g.name.split(":")[0] != role:
            if g.name in by_name:
                pgs[i] = by_name[g.name]
            continue
        for j, (hg, pg) in enumerate(healthy):
            if hg.bundles == g.bundles and hg.strategy == g.strategy:
                pgs[i] = pg
                del healthy[j]
                break
    mgr._placements += 1
    fresh = [(la.pg_name(f"{g.name}@{mgr._placements}"), g)
             for i, g in enumerate(plan.groups) if i not in pgs]
    made: list[Any] = []
    alive_bad = sorted((set(la.alive_bad_nodes()) | skip) & alive_nodes())
    try:
        new = iter(create_placement_groups(
            fresh, alive_bad, mgr.scope.check_stop, made=made,
            what=f" of elastic role {role!r} at {size} rank(s)",
            timeout_s=mgr.placement_timeout_s))
    except PlacementError:
        for pg in made:
            _remove(pg)
        raise
    ordered = [pgs[i] if i in pgs else next(new) for i in range(len(plan.groups))]
    kept = {id(pg) for pg in ordered}
    unused = [old_pgs[i] for i in mine if id(old_pgs[i]) not in kept]
    return plan, ordered, unused


def ask_back(mgr: Any, role: str, size: int) -> None:
    """Ask the cluster for the room ``role`` lost (``ray.autoscaler.sdk.
    request_resources`` with its node-slot bundle once per node of its size before
    the loss; a no-op without an autoscaler); withdraw the request once the role is
    back at that size. Emits ``elastic_resources_requested``."""
    wanted = mgr._wanted.get(role, 0)
    if size < wanted:
        bundles = [mgr._slot_need(role)] * (wanted // mgr.ranges[role].per_node)
    elif role in mgr._asked:
        bundles = []
    else:
        return
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        error = None
    except Exception as exc:  # noqa: BLE001 - a hint to the autoscaler, never fatal
        error = f"{type(exc).__name__}: {exc}"
    if bundles:
        mgr._asked.add(role)
    else:
        mgr._asked.discard(role)
        mgr._wanted.pop(role, None)
    mgr.scope.emit("elastic_resources_requested", role=role, bundles=bundles,
                    error=error)


def _valid(rng: NodeRange, world_size: int, global_batch: int, micro_batch: int) -> bool:
    if world_size % rng.per_node or not rng.min_ranks <= world_size <= rng.max_ranks:
        return False
    return not global_batch or global_batch % (micro_batch * world_size) == 0


def _largest_valid(rng: NodeRange, node_slots: int, global_batch: int,
                   micro_batch: int) -> int | None:
    for nodes in range(min(node_slots, rng.max_nodes), rng.min_nodes - 1, -1):
        if _valid(rng, nodes * rng.per_node, global_batch, micro_batch):
            return nodes * rng.per_node
    return None


def straggler_shrink_target(scope: JobScope, role: str) -> tuple[int | None, str]:
    """``(world size, "")`` that dropping one node of ``role`` (a straggler's) would
    shrink it to (the largest valid size of at most its size less ``per_node``
    ranks), or ``(None, why not)``: the role is not elastic, or no valid size is left
    between that and its minimum (it is at its minimum)."""
    rng = node_range(scope.spec, role)
    if rng is None:
        return None, f"role {role!r} is not elastic (no roles.{role}.nodes)"
    current = scope.graph.roles[role].total
    e = scope.spec.elastic
    target = _largest_valid(rng, current // rng.per_node - 1, int(e.global_batch),
                            int(e.micro_batch))
    if target is None:
        return None, (f"role {role!r} runs {current} rank(s), at its minimum of "
                      f"roles.{role}.nodes min {rng.min_nodes} node(s) of {rng.per_node} "
                      "(or no smaller size splits elastic.global_batch)")
    return target, ""


def restore_world_sizes(mgr: Any) -> bool:
    """A restarted master: take the world sizes back from the JobContext
    (``world_sizes``, the resize history of the manager ``mgr``) and set each role's
    total to its last one, so that the job is planned and checked at the size it ran
    at. Returns whether a resize happened (its placement groups are then not the
    spec's: the re-attach starts over, ``JobController._reattach``)."""
    import time

    history = mgr.scope.context.get("world_sizes") or []
    if not history:
        return False
    mgr.history = list(history)
    for entry in history:
        if entry.get("role") in mgr.ranges:
            mgr._set_total(entry["role"], int(entry["world_size"]))
    mgr._placements = int(time.time())  # this master's group names: new ones
    return any(e.get("reason") != "start" for e in history)


def spare_groups(mgr: Any, role: str) -> list[Any]:
    """The placement groups no current rank runs in that a resize of ``role`` may take
    back: the standby spares' own groups (past the plan's) and ``role``'s plan groups
    that a rank left (a promoted spare's rank moved to the spare's bundle; its old group
    holds the next spare or nothing)."""
    la = mgr.launcher
    if la.plan is None:
        return []
    used = {sl.pg for sl in la.plan.slots.values()}
    n = len(la.plan.groups)
    return [pg for i, pg in enumerate(la.pgs) if i not in used and (
        i >= n or la.plan.groups[i].name.split(":")[0] == role)]


def spare_room(mgr: Any, role: str, skip: set[str]) -> dict[str, dict[str, float]]:
    """node id -> the resources the groups no rank runs in (:func:`spare_groups`) hold on
    that alive node outside ``skip``: room for a resize of ``role``, which removes those
    groups first (:func:`release_spares`)."""
    alive = alive_nodes()
    out: dict[str, dict[str, float]] = {}
    for pg in spare_groups(mgr, role):
        t = _pg_table(pg)
        if t.get("state") != "CREATED":
            continue
        for b, node in (t.get("bundles_to_node_id") or {}).items():
            if node in alive and node not in skip:
                held = out.setdefault(node, {})
                for k, v in pg.bundle_specs[int(b)].items():
                    held[k] = held.get(k, 0.0) + float(v)
    return out


def release_spares(mgr: Any, role: str) -> None:
    """Before a resize of ``role``: kill the standby spares and remove the groups no rank
    runs in (:func:`spare_groups`), so that the room they hold, which the manager's
    ``node_slots`` counted, is there for the new size; the standby pool makes a new
    spare after the resize, where room is left."""
    groups = spare_groups(mgr, role)
    mgr.standby.drop()
    for pg in groups:
        _remove(pg)
    mgr.standby.forget_slots()


def _pg_table(pg: Any) -> dict:
    """Ray's placement-group table entry of ``pg`` (``state``, ``bundles_to_node_id``),
    ``{}`` when Ray does not know it."""
    import ray

    try:
        return ray.util.placement_group_table(pg) or {}
    except Exception:  # noqa: BLE001 - removed, or the GCS does not answer
        return {}


def _remove(pg: Any) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already gone
        pass
