"""Built-in placement policies ``pack`` and ``spread``.

Both place each collocation group on its own bundles: bundle ``i`` of a group
hosts rank ``i`` of every role in it, and holds, per resource, the largest
request among those roles; each collocated actor asks for ``1/len(roles)`` of
the bundle (fractional resources), so the roles share the same devices.

- ``pack``: one ``STRICT_PACK`` placement group per node-slot of ``per_node``
  bundles (a role's ranks ``[k*per_node, (k+1)*per_node)`` share a node); groups
  may land on the same node. When the job sets ``node_num``, a group spanning several
  nodes is one ``STRICT_SPREAD`` placement group instead, one bundle per node-slot
  holding its ``per_node`` ranks, so the ranks spread over that many distinct nodes.
- ``spread``: one ``SPREAD`` placement group per collocation group, so Ray puts
  bundles on as many nodes as it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlrover_core.placement import (
    ClusterResources,
    InstanceSlot,
    PlacementError,
    PlacementGroupPlan,
    PlacementPlan,
    add_group,
    group_bundle,
)

if TYPE_CHECKING:
    from dlrover_core.graph.graph import CollocationGroup, ComputationGraph


def _check_fits(graph: ComputationGraph, cluster: ClusterResources,
                plan: PlacementPlan) -> None:
    demand: dict[str, float] = {}
    for g in plan.groups:
        for b in g.bundles:
            for k, v in b.items():
                demand[k] = demand.get(k, 0.0) + v
    for k, v in demand.items():
        have = cluster.total(k)
        if v > have + 1e-9:
            raise PlacementError(
                f"the job needs {v:g} {k} in all but the cluster has {have:g} "
                f"({len(cluster.nodes)} alive node(s)); lower roles.*.total or resources, "
                "or add nodes")
    for g in plan.groups:
        if g.strategy == "STRICT_SPREAD":
            fit = [n for n in cluster.nodes
                   if all(n.resources.get(k, 0.0) + 1e-9 >= v for k, v in g.bundles[0].items())]
            if len(fit) < len(g.bundles):
                raise PlacementError(
                    f"placement group {g.name} spreads over {len(g.bundles)} nodes (node_num) "
                    f"with {g.bundles[0]} on each, but only {len(fit)} node(s) have that; "
                    "lower node_num or the role's resources, or add nodes")
        if g.strategy == "STRICT_PACK":
            need = {}
            for b in g.bundles:
                for k, v in b.items():
                    need[k] = need.get(k, 0.0) + v
            if not any(all(n.resources.get(k, 0.0) + 1e-9 >= v for k, v in need.items())
                       for n in cluster.nodes):
                raise PlacementError(
                    f"placement group {g.name} needs {need} on one node and no node has it; "
                    "lower per_node or the role's resources")


def _fraction(group: CollocationGroup) -> float:
    return 1.0 / len(group.roles)


def plan_pack(graph: ComputationGraph, cluster: ClusterResources) -> PlacementPlan:
    plan = PlacementPlan()
    for group in graph.groups:
        bundle = group_bundle(graph, group)
        frac = _fraction(group)
        nodes = group.size // group.per_node
        if graph.node_num and nodes > 1:
            _spread_nodes(plan, group, bundle, frac, graph, nodes)
            continue
        for node_rank in range(nodes):
            pg = len(plan.groups)
            plan.groups.append(PlacementGroupPlan(
                f"{'+'.join(group.roles)}:{node_rank}", [dict(bundle)] * group.per_node,
                "STRICT_PACK"))
            for local in range(group.per_node):
                rank = node_rank * group.per_node + local
                for r in group.roles:
                    if rank < graph.roles[r].total:
                        plan.slots[(r, rank)] = InstanceSlot(
                            pg, local, {k: v * frac for k, v in bundle.items()},
                            node_rank, local, group.per_node)
    _check_fits(graph, cluster, plan)
    return plan


def _spread_nodes(plan: PlacementPlan, group: CollocationGroup, bundle: dict[str, float],
                  frac: float, graph: ComputationGraph, nodes: int) -> None:
    """One ``STRICT_SPREAD`` group of ``nodes`` bundles, bundle ``k`` holding node-slot
    ``k``'s ``per_node`` ranks (each rank asks for its share of it)."""
    pg = len(plan.groups)
    node_bundle = {k: v * group.per_node for k, v in bundle.items()}
    plan.groups.append(PlacementGroupPlan("+".join(group.roles),
                                          [dict(node_bundle)] * nodes, "STRICT_SPREAD"))
    for rank in range(group.size):
        for r in group.roles:
            if rank < graph.roles[r].total:
                plan.slots[(r, rank)] = InstanceSlot(
                    pg, rank // group.per_node, {k: v * frac for k, v in bundle.items()},
                    rank // group.per_node, rank % group.per_node, group.per_node)


def plan_spread(graph: ComputationGraph, cluster: ClusterResources) -> PlacementPlan:
    plan = PlacementPlan()
    for group in graph.groups:
        add_group(plan, graph, group, group_bundle(graph, group), "SPREAD")
    _check_fits(graph, cluster, plan)
    return plan
