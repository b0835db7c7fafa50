"""Node loss under a script role: a tiny plain torchrun script (no dlrover import, gloo,
its own snapshot) runs 2 ranks on 2 worker nodes of a ``ray.cluster_utils.Cluster`` (its
own Ray, in a subprocess: ``tests/scenarios/script_node_loss.py``); the node of rank 1 is
removed (``cluster.remove_node``) after the first snapshot.

- ``fixed``: a third worker node is there; the failover policy re-places the role away
  from the lost node and restarts both ranks (``TORCHELASTIC_RESTART_COUNT`` 1), which
  resume from the snapshot and reach the loss of an uninterrupted run.
- ``elastic`` (``roles.trainer.nodes: "1:2"``, the YAML form of ``dlrover-run --nnodes
  1:2``): no node left for rank 1; the role shrinks to 1 rank, which resumes from the
  snapshot and runs to the last step.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from dlrover_core.master.events import read_events
from tests.scenarios.script_node_loss import SAVE_EVERY, STEPS
from tests.scenarios import run_scenario


def _run(tmp_path, mode: str) -> tuple[dict, str, str]:
    job_dir, work = tmp_path / "job", tmp_path / "work"
    return run_scenario("script_node_loss", job_dir, work, mode, timeout=480), str(job_dir), \
        str(work)


def _starts(work: str) -> list[dict]:
    with open(os.path.join(work, "out.json.starts")) as f:
        return [json.loads(line) for line in f]


def _events(job_dir: str, name: str) -> list[dict]:
    return [e for e in read_events(os.path.join(job_dir, "events.jsonl")) if e["event"] == name]


def _failures_seen(job_dir: str) -> list[tuple]:
    """What the master saw and decided about failures (shown when a job did not succeed:
    a re-placement once found too few CPUs; which nodes had failed, at which level)."""
    path = os.path.join(job_dir, "events.jsonl")
    return [(e["event"], e.get("rank"), e.get("kind"), e.get("level"), e.get("node_id"),
             str(e.get("message", ""))[:160])
            for e in (read_events(path) if os.path.exists(path) else [])
            if e["event"] in ("instance_failed", "failure_classified", "recovery_started",
                              "node_check", "node_check_kept")]


def _check_node_loss_recorded(res: dict, job_dir: str) -> tuple[dict, int]:
    """The summary and events record the loss of rank 1's node; returns the summary and
    the number of restarts (1, or more when a survivor's broken collective reached the
    master before the node's loss did)."""
    summary = res["summary"]
    assert summary is not None and summary["status"] == "succeeded", (
        summary, _failures_seen(job_dir))
    removed = res["removed"]
    assert removed and res["ranks_at_removal"]["trainer-1"] == removed
    assert summary["restarts"]["node"] == 1
    lost = [f for f in summary["failures"] if f["kind"] == "node_lost"]
    assert [(f["rank"], f["level"], f["role"]) for f in lost] == [(1, "node", "trainer")]
    events = [e for e in _events(job_dir, "instance_failed") if e["kind"] == "node_lost"]
    assert [(e["rank"], e["node_id"]) for e in events] == [(1, removed)]
    assert "node" in [e["level"] for e in _events(job_dir, "failure_classified")]
    return summary, int(summary["restarts"]["total"])


@pytest.mark.slow
def test_script_role_survives_node_loss_on_the_nodes_left(tmp_path):
    res, job_dir, work = _run(tmp_path, "fixed")
    _, restarts = _check_node_loss_recorded(res, job_dir)
    # re-placed away from the lost node; every rank restarted with each recovery
    placements = _events(job_dir, "placement")
    assert placements[-1]["excluded_nodes"] == [res["removed"]]
    started = _events(job_dir, "instance_started")
    last = {e["rank"]: e for e in started}  # each rank's newest start
    assert sorted(last) == [0, 1] and {e["attempt"] for e in last.values()} == {restarts}
    assert all(e["node_id"] != res["removed"] for e in last.values())
    assert "node" in [e["level"] for e in _events(job_dir, "recovery_finished")]
    # TORCHELASTIC_RESTART_COUNT as each script start saw it: 0 .. restarts, both ranks
    starts = _starts(work)
    for rank in (0, 1):
        seen = sorted(s["restart_count"] for s in starts if s["rank"] == rank)
        assert seen == list(range(restarts + 1)), (rank, starts)
    assert all(s["resumed_from"] >= SAVE_EVERY and s["world_size"] == 2
               for s in starts if s["restart_count"] == restarts)
    out = json.loads((tmp_path / "work" / "out.json").read_text())
    assert (out["steps"], out["restart_count"], out["world_size"]) == (STEPS, restarts, 2)
    ref = subprocess.run([sys.executable, os.path.join(work, "tiny_train.py"), "--reference",
                          str(STEPS), "2"], capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout)["final_loss"]
    assert out["final_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-9), (out, expected)
    _check_timeline(job_dir, tmp_path)


@pytest.mark.slow
def test_elastic_script_role_shrinks_after_node_loss(tmp_path):
    res, job_dir, work = _run(tmp_path, "elastic")
    summary, restarts = _check_node_loss_recorded(res, job_dir)
    sizes = [(w["world_size"], w["reason"]) for w in summary["world_sizes"]]
    assert sizes[0] == (2, "start") and sizes[-1] == (1, "shrink"), summary["world_sizes"]
    resized = _events(job_dir, "elastic_resized")
    assert (resized[-1]["previous"], resized[-1]["world_size"]) == (2, 1)
    starts = _starts(work)
    assert [s["world_size"] for s in starts if s["rank"] == 1] == [2]  # never again
    final = [s for s in starts if s["rank"] == 0 and s["restart_count"] == restarts]
    assert len(final) == 1 and final[0]["world_size"] == 1
    assert final[0]["resumed_from"] >= SAVE_EVERY
    out = json.loads((tmp_path / "work" / "out.json").read_text())
    assert (out["steps"], out["restart_count"], out["world_size"]) == (STEPS, restarts, 1)


def _check_timeline(job_dir: str, tmp_path) -> None:
    """``dlrover timeline --json`` and the PNG of the job: no steps; each attempt says how
    it ended (rank 1's first: its node was lost; the second ones: the script exited 0)."""
    from dlrover_core.cli.main import main

    buf = tmp_path / "timeline.json"
    with open(buf, "w") as f, contextlib.redirect_stdout(f):
        assert main(["timeline", "script-node-fixed", "--job-dir", job_dir, "--json"]) == 0
    tl = json.loads(buf.read_text())
    assert tl["script_roles"] == ["trainer"] and tl["steps"] == [] and tl["goodput"] is None
    rows = {r["label"]: [(a["outcome"], a["exit"]) for a in r["attempts"]]
            for r in tl["rows"]}
    assert sorted(rows) == ["trainer-0", "trainer-1"]
    assert ("failed", "node_lost") in rows["trainer-1"]
    for label in rows:
        assert rows[label][-1] == ("finished", "exit code 0"), rows
    # rank 0's first script was stopped by the recovery (or failed on its broken collective)
    first = rows["trainer-0"][0]
    assert first[0] in ("restarted", "failed") and first[1], rows
    assert "node" in [r["level"] for r in tl["recoveries"]]
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert main(["timeline", "script-node-fixed", "--job-dir", job_dir, "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000

