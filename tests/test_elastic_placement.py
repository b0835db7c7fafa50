"""The elastic manager's resize against real placement groups on the session's local Ray
(4 CPUs): the placement of a new size is reserved before any rank is stopped; a grow
that cannot be placed is dropped without stopping anything; a shrink that cannot be
placed at its target tries the next smaller size.

The job around it is a stand-in (``SimpleNamespace`` scope, launcher and standby pool
that record what is asked of them) so that the test can hold the cluster's CPUs with
placement groups of "another job" exactly; ``tests/test_elastic_busy.py`` runs it in a
real job on a several-node cluster."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from dlrover_core import load_spec
from dlrover_core.builtin.placement import plan_pack
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.master.elastic import ElasticManager
from dlrover_core.master.launcher import create_placement_groups
from dlrover_core.master.failover import JobFailed
from dlrover_core.placement import ClusterResources


def _manager(total: int):
    spec = load_spec({
        "name": "fb", "roles": {"t": {"workload": "x:Y", "total": total, "per_node": 1,
                                      "nodes": "1:4", "backend": "ddp",
                                      "resources": {"cpu": 1}}},
        # 3 s: a group that fits was once not ready within 1 s on 2 busy cores (make test
        # SLOW=1 beside another suite); each placement that cannot fit waits this long
        "elastic": {"placement_timeout_s": 3}})
    log: list = []
    scope = SimpleNamespace(
        spec=spec, graph=ComputationGraph.from_spec(spec), name="fb",
        failover=SimpleNamespace(bad_nodes=set()), checkpoint_steps={},
        instances=SimpleNamespace(roles={}), context=SimpleNamespace(set=lambda *a: None),
        check_stop=lambda: None, emit=lambda event, **kw: log.append((event, kw)))
    la = SimpleNamespace(plan=None, pgs=[], phases={},
                         pg_name=lambda name: f"dlrover-fb-{name}",
                         alive_bad_nodes=lambda: [],
                         stop_instances=lambda insts: log.append(("stopped", {})),
                         start_roles=lambda roles, attempts: log.append(
                             ("started", {"ranks": sorted(k for _, k in attempts)})))
    la.make_plan = lambda: plan_pack(scope.graph, ClusterResources.from_ray())
    la.plan = la.make_plan()
    la.pgs = create_placement_groups([(f"dlrover-fb-{g.name}", g) for g in la.plan.groups],
                                     [], lambda: None, made=[])
    standby = SimpleNamespace(kept_out={}, drop=lambda: None, ensure=lambda: None,
                              forget_slots=lambda: None)
    _settled()
    return ElasticManager(scope, la, standby), la, log


def _settled(timeout_s: float = 10.0) -> None:
    """Wait until Ray's view of the free CPUs (what ``node_slots`` reads) shows every
    placement group created or removed so far: it lags ``pg.ready()`` by a resource
    report (make test once counted 4 free CPUs right after a group had taken 2). No
    actor holds CPUs in these tests, so free = total - what CREATED groups hold."""
    from ray._private.state import available_resources_per_node

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = sum(b.get("CPU", 0.0) for pg in ray.util.placement_group_table().values()
                   if pg["state"] == "CREATED" for b in pg["bundles"].values())
        free = sum(n.get("CPU", 0.0) for n in available_resources_per_node().values())
        if abs(free - (ray.cluster_resources().get("CPU", 0.0) - held)) < 1e-6:
            return
        time.sleep(0.05)


def _hold(cpus: float):
    pg = placement_group([{"CPU": cpus}])
    ray.get(pg.ready(), timeout=30)
    _settled()
    return pg


@pytest.fixture
def cleanup():
    made: list = []
    yield made
    for pg in made:
        remove_placement_group(pg)


def test_grow_counts_what_is_free_and_a_grow_that_cannot_be_placed_is_dropped(
        ray_cluster, cleanup):
    m, la, log = _manager(1)
    cleanup.extend(la.pgs)
    other = _hold(2)  # another job: 4 CPUs, 1 ours, 2 theirs -> room for 2 ranks
    cleanup.append(other)
    assert m.node_slots("t") == 2
    assert m.largest_valid("t", m.node_slots("t")) == 2
    # a grow to 4 that cannot be placed: the grow to 3 cannot either, then 2 fits
    out = m.resize("t", 4, "grow")
    cleanup.extend(la.pgs)
    assert out is not None and out["world_size"] == 2
    failed = [kw["world_size"] for ev, kw in log if ev == "elastic_placement_failed"]
    assert failed == [4, 3]
    assert [ev for ev, _ in log if ev in ("stopped", "started")] == ["stopped", "started"]
    # the rank that ran keeps its placement group: one new group, two in all
    assert len(la.pgs) == 2 and la.plan.slots[("t", 1)].pg == 1
    log.clear()
    # no more room at all: the grow is dropped and no rank is stopped
    assert m.resize("t", 3, "grow") is None
    assert [ev for ev, _ in log if ev in ("stopped", "started")] == []
    dropped = [kw for ev, kw in log if ev == "elastic_grow_dropped"]
    assert len(dropped) == 1 and "was not ready within 3 s" in dropped[0]["reason"]
    assert m.scope.graph.roles["t"].total == 2


def test_a_shrink_that_cannot_be_placed_tries_the_next_smaller_size(ray_cluster, cleanup):
    m, la, log = _manager(2)
    cleanup.extend(la.pgs)
    # the role's groups are gone (its node is "lost" for this test) and another job
    # took 3 of the 4 CPUs: 2 ranks cannot be placed, 1 can
    for pg in la.pgs:
        remove_placement_group(pg)
    cleanup.append(_hold(3))
    out = m.resize("t", 2, "shrink")
    cleanup.extend(la.pgs)
    assert out["world_size"] == 1 and m.scope.graph.roles["t"].total == 1
    assert [kw["world_size"] for ev, kw in log if ev == "elastic_placement_failed"] == [2]
    resized = [kw for ev, kw in log if ev == "elastic_resized"]
    assert resized[0]["reason"] == "shrink (placed at 1 of 2)"
    # the last rank's group goes too and another job takes its CPU: not even MIN fits,
    # with the ranks running or after stopping them; the job fails saying what was tried
    for pg in la.pgs:
        remove_placement_group(pg)
    cleanup.append(_hold(1))
    log.clear()
    with pytest.raises(JobFailed, match=r"could not be placed at any valid size from 1 "
                                        r"down to roles.t.nodes minimum 1 node\(s\) of 1: "
                                        r"1 rank\(s\): placement group t:0"):
        m.resize("t", 1, "shrink")
    assert [kw["world_size"] for ev, kw in log if ev == "elastic_placement_failed"] == [1, 1]
    assert ("stopped", {}) in log and not any(ev == "started" for ev, _ in log)


def test_a_grow_counts_and_takes_the_room_its_standby_spare_holds(ray_cluster, cleanup):
    """The standby spare's own placement group (past the plan's groups) holds the only
    room left (found by the elastic chaos run: the returned node's CPUs went to the new
    spare, and the role never grew back). The room counts for a grow, and the grow
    kills the spare and removes its group before it reserves; the pool is asked for a
    new spare afterwards only when the grow is dropped."""
    m, la, log = _manager(1)
    cleanup.extend(la.pgs)
    other = _hold(1)   # another job: of the 4 CPUs, 1 ours, 1 theirs, 1 free, 1 the spare's
    cleanup.append(other)
    spare = _hold(1)   # the spare's own group
    la.pgs.append(spare)
    cleanup.append(spare)
    calls: list = []
    m.standby = SimpleNamespace(kept_out={}, drop=lambda: calls.append("drop"),
                                ensure=lambda: calls.append("ensure"),
                                forget_slots=lambda: calls.append("forget"))
    assert m.node_slots("t") == 3          # its own, the free CPU, the spare's
    out = m.resize("t", 3, "grow")
    cleanup.extend(la.pgs)
    assert out is not None and out["world_size"] == 3
    assert calls[:2] == ["drop", "forget"] and "ensure" in calls
    assert ray.util.placement_group_table(spare)["state"] == "REMOVED"


def test_a_resize_takes_back_the_group_a_promoted_rank_left(ray_cluster, cleanup):
    """After a spare's promotion a rank runs in the spare's group and its old plan group
    holds the next spare or nothing: that room counts for a resize, which removes the
    group first (found by the elastic chaos run: the only other node held that group,
    so a node loss counted 0 node-slots and failed the job)."""
    m, la, log = _manager(2)
    cleanup.extend(la.pgs)
    filler = _hold(1)   # another job
    cleanup.append(filler)
    moved = _hold(1)    # the promoted rank 1 moved here (a spare's group)...; 4 CPUs held
    cleanup.append(moved)
    la.pgs.append(moved)
    la.plan.slots[("t", 1)] = la.plan.slots[("t", 1)].__class__(
        **{**la.plan.slots[("t", 1)].__dict__, "pg": len(la.pgs) - 1, "bundle": 0})
    left = la.pgs[1]    # ... leaving its plan group unused
    # the ranks' groups (rank 0's, rank 1's new one) and the one rank 1 left
    assert m.node_slots("t") == 3
    out = m.resize("t", 1, "shrink")
    cleanup.extend(la.pgs)
    assert out is not None and out["world_size"] == 1
    assert ray.util.placement_group_table(left)["state"] == "REMOVED"


def test_start_over_removes_the_groups_of_an_elastic_resize(ray_cluster):
    """A restarted JobMaster that cannot re-attach starts the job over: it must remove
    every placement group of the job, also those a resize made
    (``dlrover-<job>-<group>@<n>``: found by the elastic chaos run, whose start-over
    could not place while the resized groups held the CPUs), and no other job's."""
    from dlrover_core.master.launcher import Launcher

    names = {"dlrover-jobx-trainer:0@3": True, "dlrover-jobx-trainer:1": True,
             "dlrover-jobx-trainer-spare-ab12cd": True, "dlrover-jobx-trainer@2": True,
             "dlrover-jobx2-trainer:0": False, "dlrover-jobx-trainerz:0": False}
    pgs = {n: placement_group([{"CPU": 0.01}], name=n) for n in names}
    try:
        ray.get([pg.ready() for pg in pgs.values()], timeout=60)
        la = SimpleNamespace(pgs=[], scope=SimpleNamespace(graph=SimpleNamespace(
            roles={"trainer": None})), pg_name=lambda g: f"dlrover-jobx-{g}")
        Launcher.remove_placement(la)
        gone = {n: ray.util.placement_group_table(pg)["state"] == "REMOVED"
                for n, pg in pgs.items()}
        assert gone == names
    finally:
        for pg in pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - removed by the test already
                pass


def test_a_restarted_master_takes_the_world_sizes_back(ray_cluster, cleanup):
    """``restore_world_sizes``: the resize history in the JobContext sets each elastic
    role's total to its last size (the start-over plans it there: at the spec's size,
    with a node still missing, the placement failed the job) and says that a resize
    happened; a context without history changes nothing."""
    from dlrover_core.master.elastic_room import restore_world_sizes

    m, la, _ = _manager(2)
    cleanup.extend(la.pgs)
    m.scope.context = SimpleNamespace(get=lambda k: None)
    assert restore_world_sizes(m) is False and m.scope.graph.roles["t"].total == 2
    history = [{"role": "t", "world_size": 2, "step": -1, "reason": "start"},
               {"role": "t", "world_size": 1, "step": 40, "reason": "shrink"}]
    m.scope.context = SimpleNamespace(get=lambda k: history if k == "world_sizes" else None)
    assert restore_world_sizes(m) is True
    assert m.scope.graph.roles["t"].total == 1 and m.history == history
