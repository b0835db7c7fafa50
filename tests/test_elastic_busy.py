"""An elastic role on a cluster it shares, for real on a 4-node ``ray.cluster_utils.Cluster``
(its own Ray, in a subprocess: ``tests/scenarios/elastic_busy.py``): another job holds 1
of the third worker's 2 CPUs, so the trainer (one 2-CPU rank per node) does not grow onto
it, as it did when room was counted from the nodes' totals (then it stopped its ranks,
waited 120 s for a placement that could not come, and the job failed). Once the other
job lets go, the trainer grows to 3 ranks; a trainer node is removed, the trainer
shrinks to 2 and asks the cluster for the node back (``request_resources``), and trains
to the end of the data with ``batches_per_shard`` 4 (the ranks end at the same step).

From the sample ids each rank logged per step (with its shard-service generation): every
sample is in a committed step exactly once (0 lost, 0 duplicated), and the steps rolled
back by the two restores, reported apart, are what the ledger counts as re-read."""

from __future__ import annotations


import pytest

from tests.elastic_workloads import read_ids
from tests.scenarios.elastic_busy import EVERY, RELEASE_AT, REMOVE_AT, STEPS, G
from tests.scenarios import run_scenario


@pytest.mark.slow
def test_busy_node_is_not_counted_and_a_lost_node_is_asked_back(tmp_path):
    job_dir = tmp_path / "job"
    res = run_scenario("elastic_busy", job_dir)
    summary, events = res["summary"], res["events"]
    assert summary is not None and summary["status"] == "succeeded", summary
    sizes = [(w["world_size"], w["reason"]) for w in summary["world_sizes"]]
    assert sizes == [(2, "start"), (3, "grow"), (2, "shrink")], sizes
    # no room was seen on the busy node while the other job held part of it
    room = [e for e in events if e["event"] == "elastic_room"]
    assert room and min(e["ts"] for e in room) >= res["released_ts"], (room, res)
    assert summary["world_sizes"][1]["step"] >= RELEASE_AT
    assert summary["world_sizes"][2]["step"] >= REMOVE_AT
    # the lost node was asked back: the role's node-slot bundle, once per node it had
    asked = [e for e in events if e["event"] == "elastic_resources_requested"]
    assert len(asked) == 1 and asked[0]["bundles"] == [{"CPU": 2.0}] * 3, asked
    assert asked[0]["error"] is None  # a no-op without an autoscaler, not an error
    # per restore (shard-service generation): where it started; a step at or after a
    # later start was rolled back (re-read), the others are the final history
    ids = read_ids(str(job_dir))
    start, final, reread, steps_per_rank = ids["start"], ids["final"], ids["reread"], ids["steps"]
    assert len(start) == 3, start  # the first start, the grow and the shrink
    committed = summary["checkpoint_steps"]["trainer"]
    assert committed == STEPS and committed % EVERY == 0
    assert sorted(final) == list(range(G * STEPS))  # 0 lost among committed steps
    assert set(final.values()) == {1}                 # 0 duplicated
    assert reread == summary["samples_reread_after_rollback"] > 0
    assert summary["samples_lost"] == summary["samples_duplicated"] == 0
    assert summary["samples_not_trained"] == 0
    # the last world (2 ranks after a 3 -> 2 shrink, batches_per_shard 4): same steps
    last = max(start)
    assert steps_per_rank[(last, 0)] == steps_per_rank[(last, 1)]
    assert max(steps_per_rank[(last, 0)]) == STEPS - 1
