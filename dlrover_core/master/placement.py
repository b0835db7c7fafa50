"""Kept for imports written before the placement-plan types became the public module
:mod:`dlrover_core.placement`; import from there."""

from __future__ import annotations

from dlrover_core.placement import (
    ClusterResources,
    InstanceSlot,
    NodeResources,
    PlacementError,
    PlacementGroupPlan,
    PlacementPlan,
    bundle_index,
)

__all__ = ["ClusterResources", "InstanceSlot", "NodeResources", "PlacementError",
           "PlacementGroupPlan", "PlacementPlan", "bundle_index"]
