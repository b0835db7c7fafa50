"""Shrink and grow for real on a 3-node ``ray.cluster_utils.Cluster`` (its own Ray, in a
subprocess: ``tests/scenarios/elastic_resize.py``): trainer rank 1's node is removed at
step 20, no replacement comes, the trainer continues at 1 rank from its newest
in-memory flash checkpoint (restored into the other world size); a node joins at step
32 and the trainer is back at 2 ranks after its next checkpoint. The loss curve stays on the 2-rank curve (computed here with real gloo
ranks, ``tests/elastic_math.py``) within 1e-4 at every step; from the per-rank sample-id
logs, every sample is in a committed step exactly once (the re-reads of the rolled-back
steps counted apart); and the job's other role never restarts."""

from __future__ import annotations

import os

import pytest

from dlrover_core.master.events import read_events
from tests.elastic_math import run
from tests.elastic_workloads import read_ids
from tests.scenarios.elastic_resize import ADD_AT, EVERY, REMOVE_AT, STEPS, B, G
from tests.scenarios import run_scenario


@pytest.mark.slow
def test_shrink_then_grow_on_the_two_rank_curve(tmp_path):
    job_dir = tmp_path / "job"
    res = run_scenario("elastic_resize", job_dir, "flash")
    summary = res["summary"]
    assert summary is not None and summary["status"] == "succeeded", summary
    sizes = [(w["world_size"], w["reason"]) for w in summary["world_sizes"]]
    assert sizes == [(2, "start"), (1, "shrink"), (2, "grow")]
    shrink, grow = summary["world_sizes"][1], summary["world_sizes"][2]
    assert REMOVE_AT <= shrink["step"] < ADD_AT and grow["step"] >= ADD_AT
    # the 1-rank run restored from a checkpoint of the 2-rank run, and the other way
    loads = [(ld["world_size"], ld["loaded"]) for ld in res["loads"]]
    assert loads[0] == (2, None) and loads[1][0] == 1 and loads[1][1] >= REMOVE_AT - EVERY
    assert loads[2][0] == 2 and loads[2][1] > loads[1][1]
    # both resizes restored from the flash checkpoint in memory, into another world size:
    # the shrink from the replica of the removed rank's save (the scenario removes the
    # node once one is complete, of the newest checkpoint step reached); only when none
    # came in time may it load a step from disk, and then one newer than the replica's.
    # A memory reshard reads every saved rank's buffer on the survivor's node: a replica
    # held on another node leaves the disk (make test SLOW=1, 2026-12-02: the removed
    # rank's step 20 replicated, the shrink loaded step 20 from disk; the replica's peer
    # was then the next node of the ring of all nodes, the head's too, and is now the
    # next node with ranks of the job: the survivor's here)
    sources = [ld["source"] for ld in res["loads"][1:]]
    why = (res["loads"], res["removed_at_step"], res["replicated_step"],
           res["replica_holder"], res["survivor_node"])
    here = bool(res["replica_holder"]) and \
        res["survivor_node"].startswith(res["replica_holder"])
    if loads[1][1] <= res["replicated_step"] and here:
        assert sources == ["memory-resharded"] * 2, why
    elif loads[1][1] <= res["replicated_step"]:  # the replica not on the survivor's node
        assert sources == ["disk-resharded", "memory-resharded"], why
    else:
        assert sources == ["disk-resharded", "memory-resharded"], why
        assert res["removed_at_step"] >= ADD_AT - 2 * EVERY, why
    # from the per-rank sample-id logs: every sample in a committed step exactly once
    # (0 lost, 0 duplicated); the steps the two restores rolled back are re-reads,
    # counted apart, as the ledger counts them
    ids = read_ids(str(job_dir))
    assert len(ids["start"]) == 3, ids["start"]  # the first start, the shrink, the grow
    assert summary["checkpoint_steps"]["trainer"] == STEPS
    assert sorted(ids["final"]) == list(range(G * STEPS))
    assert set(ids["final"].values()) == {1}
    assert ids["reread"] == summary["samples_reread_after_rollback"]
    assert summary["samples_lost"] == summary["samples_duplicated"] == 0
    assert summary["restarts"]["node"] == 1
    # the other role kept its process through both resizes: one start (attempt 0, or
    # the next one when the job's first start failed on a loaded machine: the failures
    # are in the message)
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    watcher = [e for e in events if e["event"] == "instance_started" and e["role"] == "watcher"]
    failed = [e for e in events if e["event"] in ("instance_failed", "failure_classified")]
    assert len(watcher) == 1, (watcher, failed)
    assert watcher[0]["attempt"] == 0 or (failed and failed[0]["ts"] < watcher[0]["ts"]), \
        (watcher, failed)
    reference = run([(0, 2)], steps=STEPS, global_batch=G, micro=B)
    losses = {int(k): v for k, v in res["losses"].items()}
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(losses[step] - reference[step]) <= 1e-4, (step, losses[step], reference[step])
