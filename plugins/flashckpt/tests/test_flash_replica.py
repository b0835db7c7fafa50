"""Replicas in a peer node's memory (``checkpoint.options.replicas: 1``) on a 2-node
``ray.cluster_utils.Cluster``: the node holding the shards is removed and the new
ranks restore the newest saved step from the peer's memory, not the newest persisted
one from disk, and a smaller job on the peer restores it resharded from the replicas
(see replica_scenario.py; its own Ray, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCENARIO = os.path.join(os.path.dirname(__file__), "replica_scenario.py")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "ray"])
def test_node_loss_restores_the_newest_saved_step_from_the_peer_replica(tmp_path, transport):
    run = subprocess.run([sys.executable, SCENARIO, str(tmp_path), transport],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["saved_on"] == [res["node_a"]] * 2
    assert res["waited"] == [[0, 3], [1, 3]]   # wait_replica returned with both
    assert {(r["rank"], r["step"]) for r in res["replicas"]} >= {(0, 3), (1, 3)}
    assert all(r["peer"] != res["node_a"] for r in res["replicas"])
    # tcp: sent over one connection into the peer's buffer; ray: the object store
    assert {r["transport"] for r in res["replicas"]} == {transport}
    if transport == "tcp":   # one connection carried them all (opened by the first
        # replica, which may have been dropped: overwritten by the next save while sent)
        opened = [r["connect_s"] > 0 for r in res["replicas"]]
        assert sum(opened) <= 1 and opened[1:] == [False] * (len(opened) - 1), res["replicas"]
    assert res["committed_before"][-1] == 2  # the disk is one save behind
    assert res["removed_buffers"] >= 2
    assert all(n not in (res["node_a"], res["node_b"]) for n in res["restored_on"])
    assert res["loads"] == [{"step": 3, "source": "replica", "exact": True}] * 2
    # one rank on the replicas' holder restores the 2-rank save from them
    assert res["smaller_on"] == res["replicas"][-1]["peer"]
    assert res["smaller_load"] == {"step": 3, "source": "memory-resharded", "exact": True}


def test_the_peer_is_the_next_node_with_ranks_of_the_job_when_there_is_one():
    """The ring of the nodes with ranks of the job; every alive node only when no other
    node has any (a node that only ran the JobMaster held a lost rank's replica, and the
    shrink onto the survivor, which reshards from its own node's buffers, loaded from
    disk)."""
    from dlrover_plugin_flashckpt.replica import peer_of

    alive = ["a-head", "b-rank", "c-rank"]
    assert peer_of("c-rank", alive) == "a-head"           # the ring of every node
    assert peer_of("c-rank", alive, ["b-rank", "c-rank"]) == "b-rank"
    assert peer_of("b-rank", alive, ["b-rank", "c-rank"]) == "c-rank"
    assert peer_of("b-rank", alive, ["b-rank"]) == "c-rank"   # no other: every node
    assert peer_of("b-rank", ["b-rank", "c-rank"], ["b-rank", "d-gone"]) == "c-rank"
    assert peer_of("b-rank", ["b-rank"], ["b-rank"]) is None
