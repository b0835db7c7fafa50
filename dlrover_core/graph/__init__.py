"""ComputationGraph: roles, edges, collocation groups."""

from dlrover_core.graph.graph import CollocationGroup, ComputationGraph, Resources, Role

__all__ = ["CollocationGroup", "ComputationGraph", "Resources", "Role"]
