"""Placement policies on plans, and on a real Ray cluster (actual bundles and nodes)."""

from __future__ import annotations

import pytest

from dlrover_core import load_spec
from dlrover_core.builtin.placement import plan_pack, plan_spread
from dlrover_core.graph import ComputationGraph
from dlrover_core.master.placement import ClusterResources, NodeResources, PlacementError

W = "tests.workloads:Echo"


def graph(collocation=(), **totals):
    spec = load_spec({"name": "p", "driver": "tests.workloads:PingDriver",
                      "roles": {r: {"workload": W, "total": t, "per_node": pn,
                                    "resources": {"cpu": 1}}
                                for r, (t, pn) in totals.items()},
                      "collocation": [list(g) for g in collocation]})
    return ComputationGraph.from_spec(spec)


def cluster(*cpus):
    return ClusterResources([NodeResources(f"n{i}", "127.0.0.1", {"CPU": c})
                             for i, c in enumerate(cpus)])


def test_graph_order_and_groups():
    g = graph(collocation=[["actor", "rollout"]], actor=(2, 2), rollout=(2, 2), critic=(1, 1))
    assert [grp.roles for grp in g.groups] == [("actor", "rollout"), ("critic",)]
    assert g.group_of("rollout").size == 2


def test_pack_collocated_roles_share_bundles_with_fractions():
    g = graph(collocation=[["actor", "rollout"]], actor=(2, 2), rollout=(2, 2), critic=(2, 1))
    plan = plan_pack(g, cluster(4, 4))
    # actor+rollout: one STRICT_PACK group of 2 bundles; critic: per_node=1 -> 2 groups
    assert [(p.strategy, len(p.bundles)) for p in plan.groups] == [
        ("STRICT_PACK", 2), ("STRICT_PACK", 1), ("STRICT_PACK", 1)]
    a0, r0 = plan.slots[("actor", 0)], plan.slots[("rollout", 0)]
    assert (a0.pg, a0.bundle) == (r0.pg, r0.bundle) == (0, 0)
    assert a0.resources == {"CPU": 0.5} and plan.groups[0].bundles[0] == {"CPU": 1.0}
    assert plan.slots[("critic", 1)].pg == 2 and plan.slots[("critic", 1)].node_rank == 1


def test_spread_one_group_per_collocation_group():
    g = graph(trainer=(4, 2))
    plan = plan_spread(g, cluster(2, 2))
    assert [(p.strategy, len(p.bundles)) for p in plan.groups] == [("SPREAD", 4)]
    assert [plan.slots[("trainer", r)].local_rank for r in range(4)] == [0, 1, 0, 1]


def test_does_not_fit():
    g = graph(trainer=(4, 4))
    with pytest.raises(PlacementError, match=r"needs 4 CPU in all but the cluster has 2"):
        plan_pack(g, cluster(2))
    with pytest.raises(PlacementError, match=r"needs \{'CPU': 4.0\} on one node"):
        plan_pack(g, cluster(2, 2))


def test_actual_placement_through_ray(ray_cluster, job_dir):
    """Collocated roles land in the same bundle of the same placement group (Ray's own
    view: each actor's assigned resources name its bundle)."""
    import ray

    from dlrover_core.master.client import create_master

    spec = load_spec({"name": "placed", "driver": "tests.workloads:PingDriver",
                      "config": {"n": 2},
                      "roles": {"producer": {"workload": W, "total": 2, "resources": {"cpu": 1}},
                                "consumer": {"workload": W, "total": 2, "resources": {"cpu": 1}}},
                      "collocation": [["producer", "consumer"]]})
    master = create_master(spec, job_dir)
    try:
        ray.get(master.start.remote())
        summary = ray.get(master.wait.remote(120))
        assert summary["status"] == "succeeded", summary["error"]
    finally:
        ray.kill(master)
    import json
    import os

    placement = [e for e in map(json.loads, open(os.path.join(job_dir, "events.jsonl")))
                 if e["event"] == "placement"][0]
    assert placement["groups"] == [{"name": "producer+consumer:0", "strategy": "STRICT_PACK",
                                    "bundles": [{"CPU": 1.0}, {"CPU": 1.0}]}]
    started = {(e["role"], e["rank"]): e for e in map(json.loads, open(os.path.join(
        job_dir, "events.jsonl"))) if e["event"] == "instance_started" and e["role"] != "driver"}
    for rank in (0, 1):
        p, c = started[("producer", rank)], started[("consumer", rank)]
        assert p["placement_group_id"] and p["placement_group_id"] == c["placement_group_id"]
        assert p["bundle_index"] == c["bundle_index"] == rank
        assert p["node_id"] == c["node_id"]
