"""Placement-plan types, public: what a placement policy (``dlrover_placement_policies``)
takes and returns.

A policy is ``plan(graph, cluster: ClusterResources) -> PlacementPlan``: Ray placement
groups (``PlacementGroupPlan``: bundles and a strategy) and, for every role instance
``(role, rank)``, an ``InstanceSlot`` saying which group and bundle hosts it. It raises
``PlacementError`` when the graph cannot fit. Imports nothing heavy (Ray is imported
only by ``ClusterResources.from_ray``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlrover_core.graph.graph import CollocationGroup, ComputationGraph


def bundle_index(assigned: dict[str, float]) -> int | None:
    """The placement-group bundle an actor runs in, from Ray's per-bundle resource names
    (``CPU_group_<bundle>_<pg id>``, as ``WorkloadHost.node_info()`` reports them), or
    ``None`` outside a bundle."""
    for name in assigned:
        parts = name.split("_group_")
        if len(parts) == 2:
            idx = parts[1].split("_", 1)[0]
            if idx.isdigit():
                return int(idx)
    return None


class PlacementError(RuntimeError):
    """The graph cannot be placed on the cluster (the message says what is short)."""


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: ``node_id``, ``ip`` and its resources (``{"CPU": 2.0, "GPU":
    0.0, ...}``): its totals, or what is free on it (``ClusterResources.from_ray(
    available=True)``)."""

    node_id: str
    ip: str
    resources: dict[str, float]


@dataclass
class ClusterResources:
    """The nodes a plan may use (bad nodes already removed)."""

    nodes: list[NodeResources]

    def total(self, key: str) -> float:
        return sum(n.resources.get(key, 0.0) for n in self.nodes)

    @classmethod
    def from_ray(cls, exclude: set[str] = frozenset(),  # type: ignore[assignment]
                 available: bool = False) -> ClusterResources:
        """The alive nodes not in ``exclude`` (node ids, hex), with their total resources,
        or with ``available=True`` what is free on each now (Ray's available resources:
        the totals less what every actor, task and placement group of every job holds)."""
        import ray

        free: dict[str, dict[str, float]] = {}
        if available:
            from ray._private.state import available_resources_per_node

            free = available_resources_per_node()
        nodes = [NodeResources(n["NodeID"], n.get("NodeManagerAddress", ""),
                               dict(free.get(n["NodeID"], {}) if available
                                    else n.get("Resources", {})))
                 for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in exclude]
        return cls(nodes)


@dataclass(frozen=True)
class InstanceSlot:
    """Where one role instance goes: placement group index, bundle index, the
    resources the actor asks for (fraction of the bundle when collocated), and the
    bundle's node-slot (``node_rank``) and position on it (``local_rank``)."""

    pg: int
    bundle: int
    resources: dict[str, float]
    node_rank: int
    local_rank: int
    local_world_size: int


@dataclass
class PlacementGroupPlan:
    """One Ray placement group: ``bundles`` (resource dicts) and a ``strategy``
    (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``)."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str


@dataclass
class PlacementPlan:
    """Placement groups plus ``slots[(role, rank)]``."""

    groups: list[PlacementGroupPlan] = field(default_factory=list)
    slots: dict[tuple[str, int], InstanceSlot] = field(default_factory=dict)

    def describe(self) -> list[dict]:
        """JSON-friendly view for events and the job context."""
        return [{"name": g.name, "strategy": g.strategy, "bundles": g.bundles} for g in self.groups]


def group_bundle(graph: ComputationGraph, group: CollocationGroup) -> dict[str, float]:
    """The bundle of one collocation group: per Ray resource, the largest request among
    its roles (``roles.R.resources``); ``{"CPU": 0.001}`` when they request nothing."""
    out: dict[str, float] = {}
    for role in group.roles:
        for key, value in graph.roles[role].resources.as_ray().items():
            out[key] = max(out.get(key, 0.0), value)
    return {k: v for k, v in out.items() if v > 0} or {"CPU": 0.001}


def add_group(plan: PlacementPlan, graph: ComputationGraph, group: CollocationGroup,
              bundle: dict[str, float], strategy: str) -> None:
    """Append to ``plan`` one placement group of ``group.size`` copies of ``bundle``
    with ``strategy`` (``PACK``, ``SPREAD``, ...): bundle ``i`` hosts rank ``i`` of every
    role of the group that has one, each asking for ``1/len(group.roles)`` of the bundle
    (collocated roles share its devices), on node-slot ``i // per_node``."""
    pg = len(plan.groups)
    share = 1.0 / len(group.roles)
    plan.groups.append(PlacementGroupPlan("+".join(group.roles), [dict(bundle)] * group.size,
                                          strategy))
    for rank in range(group.size):
        for role in group.roles:
            if rank < graph.roles[role].total:
                plan.slots[(role, rank)] = InstanceSlot(
                    pg, rank, {k: v * share for k, v in bundle.items()},
                    rank // group.per_node, rank % group.per_node, group.per_node)
