"""``node_health.straggler_action: shrink`` (docs/node-health.md): a straggler's node is
dropped from its elastic role.

On a real 3-node ``ray.cluster_utils.Cluster`` (``tests.scenarios.node_health``, part
``shrink``, in a subprocess): an elastic 3-rank gloo trainer, rank 1's process slowed
from outside to 30% with SIGSTOP/SIGCONT. Without Ray: the spec check and the
detector's choice between ``shrink`` and its fallback to ``report``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dlrover_core import load_spec
from dlrover_core.master.events import read_events
from dlrover_core.master.stragglers import StragglerDetector
from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.node_health import NodeHealthSpec
from tests.scenarios import run_scenario


def _events(job_dir: str, name: str) -> list[dict]:
    return [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
            if e["event"] == name]


@pytest.mark.slow
def test_straggler_node_is_dropped_from_the_elastic_role(tmp_path):
    check_shrink(run_scenario("node_health", tmp_path, "shrink")["shrink"])


def check_shrink(part: dict) -> None:
    """The asserts on what the ``shrink`` part saw (job directory, summary, pids)."""
    job_dir, summary = part["job_dir"], part["summary"]
    assert part["slowed_pid"], "the job never reached the step where rank 1 is slowed"
    assert summary["status"] == "succeeded", summary["error"]
    found = _events(job_dir, "straggler_detected")
    assert len(found) == 1
    ev = found[0]
    assert (ev["role"], ev["rank"], ev["pid"]) == ("trainer", 1, part["slowed_pid"])
    assert ev["action"] == "shrink" and ev["target_world_size"] == 2
    assert ev["node_id"] == part["slowed_node"] and ev["ts"] > part["slowed_at"]
    failed = _events(job_dir, "instance_failed")
    assert [(e["kind"], e["rank"]) for e in failed] == [("straggler", 1)]
    # 3 ranks, then 2 on the other nodes; never grown back onto the straggler's node
    # (its CPU is free again, and the master looks for room every second)
    sizes = [(w["world_size"], w["reason"]) for w in summary["world_sizes"]]
    assert sizes == [(3, "start"), (2, "straggler")]
    shrink = summary["world_sizes"][1]
    assert shrink["step"] >= 30 and shrink["checkpoint_step"] >= 10
    started = _events(job_dir, "instance_started")
    after = [e for e in started if e["ts"] > ev["ts"]]
    assert sorted(e["rank"] for e in after) == [0, 1]
    assert all(e["node_id"] != part["slowed_node"] for e in after)
    # the 2-rank run restored the newest checkpoint of the 3-rank run
    loaded = [e for e in _events(job_dir, "checkpoint_loaded") if e["ts"] > ev["ts"]]
    assert loaded and loaded[0]["step"] == shrink["checkpoint_step"]
    assert loaded[0]["source"] == "memory-resharded"  # flash, from memory, 3 -> 2 ranks
    placed = [e for e in _events(job_dir, "placement") if e.get("role") == "trainer"]
    assert [e["straggler_nodes"] for e in placed] == [[part["slowed_node"]]]
    resized = _events(job_dir, "elastic_resized")
    assert [(e["previous"], e["world_size"]) for e in resized] == [(3, 2)]
    # the role's new spare keeps out of the dropped node, the only one with a free CPU:
    # it waits for room and never warms up
    spares = [e for e in _events(job_dir, "standby_created") if e["ts"] > ev["ts"]]
    assert spares and all(e["kept_out"] == [part["slowed_node"]] for e in spares)
    assert part["spare_warm"] and not any(part["spare_warm"]), part["spare_warm"]
    recovered = _events(job_dir, "recovery_finished")
    assert recovered and recovered[0]["phases"]["straggler_node"] == part["slowed_node"]


# ---------------------------------------------------------------- without Ray
def _spec(nodes, total=3, action="shrink", per_node=1):
    role = {"workload": "tests.node_health_workloads:SyncSteps", "total": total,
            "per_node": per_node, "backend": "ddp"}
    if nodes is not None:
        role["nodes"] = nodes
    return load_spec({"name": "x", "roles": {"trainer": role},
                      "node_health": {"straggler_action": action}})


def test_spec_accepts_shrink_on_an_elastic_role():
    assert _spec("2:3").node_health.straggler_action == "shrink"
    assert _spec("1:3", total=1).node_health.straggler_action == "shrink"


@pytest.mark.parametrize("nodes,total,detail", [
    (None, 3, "roles.trainer has 3 ranks and no node range"),
    ("3:3", 3, "MIN = MAX"),
    (None, 1, "no role with a process group and a node range"),
])
def test_spec_rejects_shrink_without_room_to_shrink(nodes, total, detail):
    with pytest.raises(SpecError, match="node_health.straggler_action") as err:
        _spec(nodes, total)
    msg = str(err.value)
    assert "'shrink'" in msg and detail in msg and "off, report or replace" in msg


def _scope(total: int, emitted: list, nodes: str = "2:3"):
    spec = OmegaConf.create({
        "node_health": vars(NodeHealthSpec(straggler_action="shrink",
                                           straggler_window_s=1.0, straggler_windows=2)),
        "roles": {"trainer": {"total": total, "per_node": 1, "nodes": nodes}},
        "elastic": {"global_batch": 0, "micro_batch": 0}})
    inst = SimpleNamespace(node_id="n1", pid=42, last_step=7, attempt=0, state="running",
                           role="trainer", rank=1)
    return SimpleNamespace(spec=spec, failover=SimpleNamespace(last_recovery_end=0.0),
                           graph=SimpleNamespace(roles={"trainer": SimpleNamespace(
                               total=total)}),
                           instances=SimpleNamespace(get=lambda role, rank: inst),
                           emit=lambda event, **f: emitted.append((event, f)))


def _two_slow_windows(det: StragglerDetector):
    found = []
    for i in range(2):
        for _ in range(3):
            det.on_report("trainer", 0, i, {"compute_s": 0.1, "step_s": 0.3})
            det.on_report("trainer", 1, i, {"compute_s": 0.3, "step_s": 0.3})
        found.append(det.check(now=det._window_start + 1.01))
    return found


def test_shrink_above_the_minimum_returns_a_straggler_failure():
    emitted = []
    found = _two_slow_windows(StragglerDetector(_scope(3, emitted)))
    assert found[0] is None and found[1].failure.kind == "straggler"
    assert (found[1].failure.rank, found[1].failure.node_id) == (1, "n1")
    ev = [f for e, f in emitted if e == "straggler_detected"]
    assert len(ev) == 1 and ev[0]["action"] == "shrink" and ev[0]["target_world_size"] == 2


def test_shrink_at_the_minimum_falls_back_to_report():
    emitted = []
    found = _two_slow_windows(StragglerDetector(_scope(2, emitted)))
    assert found == [None, None]
    ev = [f for e, f in emitted if e == "straggler_detected"]
    assert len(ev) == 1 and ev[0]["action"] == "report"
    assert ev[0]["configured_action"] == "shrink"
    assert "at its minimum" in ev[0]["fallback_reason"] and "2 rank(s)" in \
        ev[0]["fallback_reason"]
