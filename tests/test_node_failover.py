"""A node leaves a 2-node cluster (``ray.cluster_utils.Cluster``, its own Ray in a
subprocess): the job marks it bad, re-places its actors on the other node, finishes."""

from __future__ import annotations

import os

import pytest

from dlrover_core.master.events import read_events
from tests.scenarios import run_scenario


@pytest.mark.slow
def test_node_removed(tmp_path):
    job_dir = tmp_path / "job"
    res = run_scenario("node_loss", job_dir)
    summary = res["summary"]
    assert summary is not None
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["steps"] == 20
    assert summary["restarts"]["node"] == 1
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    classified = [e for e in events if e["event"] == "failure_classified"]
    assert classified[0]["level"] == "node"
    placements = [e for e in events if e["event"] == "placement"]
    assert placements[-1]["excluded_nodes"] == [res["removed_node"]]
    started = [e for e in events if e["event"] == "instance_started"]
    after = [e for e in started if e["attempt"] == 1]
    assert after and all(e["node_id"] != res["removed_node"] for e in after)
    redone = [r["step"] for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
              if r["event"] == "step"]
    assert len(redone) - len(set(redone)) <= 4  # at most the checkpoint interval


@pytest.mark.slow
def test_alive_bad_node_is_kept_out(tmp_path):
    """Bad-node exclusion on a 2-node Cluster: the node stays alive, its workers keep
    failing with a node-level verdict; the job moves to the other node and finishes."""
    job_dir = tmp_path / "job"
    res = run_scenario("bad_node", job_dir)
    summary, bad = res["summary"], res["bad_node"]
    assert summary is not None and bad is not None
    assert summary["status"] == "succeeded", summary["error"]
    assert bad in res["alive_nodes"]  # never removed: only marked bad
    assert summary["restarts"]["node"] == 1
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    classified = [e for e in events if e["event"] == "failure_classified"]
    assert classified[0]["level"] == "node"
    assert classified[0]["classifier"] == "badnode"
    placements = [e for e in events if e["event"] == "placement"]
    assert len(placements) == 2 and placements[-1]["excluded_nodes"] == [bad]
    started = [e for e in events if e["event"] == "instance_started"]
    first = [e for e in started if e["attempt"] == 0]
    after = [e for e in started if e["attempt"] >= 1]
    assert {e["node_id"] for e in first} == {bad}
    assert len(after) == 2 and all(e["node_id"] != bad for e in after)
