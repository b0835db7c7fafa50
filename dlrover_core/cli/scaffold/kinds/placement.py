"""The ``placement`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

_PLACEMENT_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` placement policy."""

from __future__ import annotations

from dlrover_core import PlacementPolicy, hookimpl
from __PKG__.policy import plan


@hookimpl
def dlrover_placement_policies() -> list[PlacementPolicy]:
    return [PlacementPolicy(name="__NAME__", plan=plan,
                            description="one PACK placement group per role group")]
'''

_PLACEMENT_POLICY = '''\
"""The ``__NAME__`` placement policy: one Ray placement group with the ``PACK``
strategy per collocation group (Ray packs its bundles on as few nodes as it can but
may use more), bundle ``i`` hosting rank ``i`` of every role in the group.

Light: no Ray import here; the JobMaster creates the placement groups from the plan.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.placement import (
    ClusterResources,
    PlacementError,
    PlacementPlan,
    add_group,
    group_bundle,
)


def plan(graph: Any, cluster: ClusterResources) -> PlacementPlan:
    """Place ``graph`` (a ``ComputationGraph``) on ``cluster``.

    Raises:
        PlacementError: the job asks for more of a resource than the cluster has.
    """
    out = PlacementPlan()
    demand: dict[str, float] = {}
    for group in graph.groups:
        # per resource the largest request of the group's roles; collocated roles
        # share each bundle (write your own bundles and slots for other layouts)
        bundle = group_bundle(graph, group)
        add_group(out, graph, group, bundle, "PACK")
        for key, value in bundle.items():
            demand[key] = demand.get(key, 0.0) + value * group.size
    for key, value in demand.items():
        if value > cluster.total(key) + 1e-9:
            raise PlacementError(f"the job needs {value:g} {key} but the cluster has "
                                 f"{cluster.total(key):g}; lower roles.*.total or add nodes")
    return out
'''

_PLACEMENT_TEST = '''\
"""The ``__NAME__`` placement policy on a graph from a real spec."""

from __future__ import annotations

import pytest

from dlrover_core import load_spec
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.placement import ClusterResources, NodeResources, PlacementError


def _graph(total: int, per_node: int = 0) -> ComputationGraph:
    spec = load_spec({"name": "p", "placement": "__NAME__",
                      "roles": {"trainer": {"workload": "a.b:C", "total": total,
                                            "per_node": per_node,
                                            "resources": {"cpu": 1}}}})
    return ComputationGraph.from_spec(spec)


def _cluster(*cpus: float) -> ClusterResources:
    return ClusterResources([NodeResources(f"n{i}", f"10.0.0.{i}", {"CPU": c})
                             for i, c in enumerate(cpus)])


def test_every_instance_has_a_bundle(plugin_manager):
    plan = plugin_manager.get_placement_policy("__NAME__").plan
    out = plan(_graph(4, per_node=2), _cluster(2, 2))
    assert [g.strategy for g in out.groups] == ["PACK"]
    assert out.groups[0].bundles == [{"CPU": 1.0}] * 4
    assert sorted(out.slots) == [("trainer", r) for r in range(4)]
    assert [out.slots[("trainer", r)].node_rank for r in range(4)] == [0, 0, 1, 1]


def test_too_big_for_the_cluster(plugin_manager):
    plan = plugin_manager.get_placement_policy("__NAME__").plan
    with pytest.raises(PlacementError, match="needs 4 CPU"):
        plan(_graph(4), _cluster(2))
'''

PLACEMENT = Kind(
    name="placement", summary="A placement policy: role instances onto Ray placement groups",
    provides=("placement:__NAME__",), hooks=("dlrover_placement_policies",),
    files={"__PKG__/plugin.py": _PLACEMENT_PLUGIN, "__PKG__/policy.py": _PLACEMENT_POLICY,
           "tests/test___NAME__.py": _PLACEMENT_TEST},
    layout=(("__PKG__/policy.py", "`plan(graph, cluster) -> PlacementPlan`"),),
    usage="In a job spec: `placement: __NAME__`.\n")
