"""``first_gone``: a node whose raylet answers is not gone; one Ray does not know is."""

from __future__ import annotations

import ray

from dlrover_core.master.raylet_probe import first_gone


def test_live_raylet_is_not_gone_and_unknown_node_is(ray_cluster):
    here = ray.get_runtime_context().get_node_id()
    assert first_gone([here]) is None
    unknown = "ab" * 28
    assert first_gone([here, unknown]) == unknown
    assert first_gone([]) is None
