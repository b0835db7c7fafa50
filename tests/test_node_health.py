"""Node health (docs/node-health.md): the pre-flight node check, stragglers, hang stacks.

The three jobs run on one 3-node ``ray.cluster_utils.Cluster`` in a subprocess
(``tests.scenarios.node_health``), run once for the module; every slowness is injected
from outside the code under test (SIGSTOP/SIGCONT). The rest checks the pieces
without Ray: the pairing rounds and verdicts, the straggler windows, the spec, the
faulthandler dump.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dlrover_core.cli.main import main as cli_main
from dlrover_core.master.events import read_events
from dlrover_core.master.node_check import NodeResult, judge, round1_pairs, round2_batches
from dlrover_core.master.stragglers import StragglerDetector, slow_ranks
from dlrover_core.runtime.stack_dump import dump_stacks, faulthandler_path, py_spy
from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.node_health import NodeHealthSpec
from tests.scenarios import run_scenario


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("node_health")
    return run_scenario("node_health", root, timeout=600)


def _events(part: dict, name: str) -> list[dict]:
    return [e for e in read_events(os.path.join(part["job_dir"], "events.jsonl"))
            if e["event"] == name]


# ---------------------------------------------------------------- on a real cluster
@pytest.mark.slow
def test_node_check_excludes_a_slowed_node(scenario, capsys):
    part = scenario["check"]
    bad = part["target_node"]
    assert bad and part["slowed_pids"], "the test did not slow a probe"
    assert part["summary"]["status"] == "succeeded", part["summary"]["error"]
    checks = _events(part, "node_check")
    first = {n["node_id"]: n for n in checks[0]["nodes"]}
    assert first[bad]["verdict"] in ("slow_compute", "failed")
    assert checks[0]["excluded"] == [bad]
    assert all(n["verdict"] == "ok" for nid, n in first.items() if nid != bad)
    # checks[2:]: after the node loss (test_a_node_the_check_excluded_is_taken_back_...)
    assert len(checks) >= 3 and bad not in {n["node_id"] for n in checks[1]["nodes"]}
    assert all(n["verdict"] == "ok" and n["gflops"] > 0 for n in checks[1]["nodes"])
    assert all(p["ok"] and p["busbw_gbps"] > 0 for n in checks[1]["nodes"] for p in n["pairs"])
    placements = _events(part, "placement")
    assert placements[1]["excluded_nodes"] == [bad]
    started = [e for e in _events(part, "instance_started") if e["attempt"] == 0]
    assert len(started) == 2 and all(e["node_id"] != bad for e in started)
    # dlrover diagnose shows the verdict per node
    assert cli_main(["diagnose", part["job_dir"], "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [n["verdict"] for n in found["node_checks"][0]["nodes"]
            if n["node_id"] == bad] == [first[bad]["verdict"]]
    assert found["node_checks"][0]["seconds"] == checks[0]["seconds"] > 0  # its duration
    assert set(checks[0]["phases"]) == {"start_s", "matmul_s", "round1_s", "round2_s"}
    assert sum(checks[0]["phases"].values()) <= checks[0]["seconds"] + 0.01
    assert cli_main(["diagnose", part["job_dir"]]) == 0
    text = capsys.readouterr().out
    assert first[bad]["verdict"] in text and "GFLOP/s" in text
    assert f"node check 1 ({checks[0]['seconds']:.1f} s" in text


@pytest.mark.slow
def test_a_node_the_check_excluded_is_taken_back_when_the_job_needs_it(scenario):
    """Rank 1's node is removed while the job runs on the two nodes the check kept: the
    two ranks no longer fit without the node the check excluded, so the recovery takes
    it back (``node_check_kept``) instead of failing the job (a CI run once failed a
    node-loss job with 'needs 2 CPU in all but the cluster has 1')."""
    part = scenario["check"]
    bad, removed = part["target_node"], part["removed"]
    assert removed and removed != bad and part["ranks_at_removal"]["trainer-1"] == removed
    summary = part["summary"]
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["node"] == 1
    # rank 1's death or rank 0's broken all_reduce, whichever came first, names the node
    failed = [(e["kind"], e["rank"], e["node_id"]) for e in _events(part, "instance_failed")]
    assert {n for kind, _, n in failed if kind == "node_lost"} == {removed}, failed
    (kept,) = _events(part, "node_check_kept")
    assert kept["nodes"] == [bad]
    assert "the job cannot be placed without them: the job needs 2 CPU" in kept["reason"]
    placements = _events(part, "placement")  # a 4th if the new check excluded and took back
    assert placements[2]["excluded_nodes"] == placements[-1]["excluded_nodes"] == [removed]
    survivor = part["ranks_at_removal"]["trainer-0"]
    third = _events(part, "node_check")[2]  # the nodes of the new placement, checked again
    assert sorted(n["node_id"] for n in third["nodes"]) == sorted([bad, survivor])
    newest = {e["rank"]: e for e in _events(part, "instance_started")}
    assert all(e["attempt"] >= 1 for e in newest.values()), newest
    assert sorted(e["node_id"] for e in newest.values()) == sorted([bad, survivor]), newest


@pytest.mark.slow
def test_straggler_is_detected_and_replaced(scenario):
    part = scenario["straggler"]
    assert part["slowed_pid"], "the job never reached the step where rank 1 is slowed"
    assert part["summary"]["status"] == "succeeded", part["summary"]["error"]
    found = _events(part, "straggler_detected")
    assert len(found) == 1
    ev = found[0]
    assert (ev["role"], ev["rank"], ev["pid"]) == ("trainer", 1, part["slowed_pid"])
    assert ev["action"] == "replace" and ev["ratio"] > 2.0 and len(ev["evidence"]) == 3
    # the feature's bound (issue 50): detected within 30 s of the slowdown's start
    assert part["slowed_at"] < ev["ts"] < part["slowed_at"] + 30
    # the workload (DDPSteps) times nothing: the phases came from the ddp backend's
    # all-reduce hook through the reporting layer
    steps = [r for r in read_events(os.path.join(part["job_dir"], "metrics.jsonl"))
             if r["event"] == "step"]
    assert steps and all({"compute_s", "comm_wait_s"} <= set(r) for r in steps
                         if r["step"] >= 1)  # a process's first report has no interval
    waits = {"0": 0.0, "1": 0.0}
    for window in ev["evidence"]:  # the evidence: rank 1 computes, rank 0 waits
        r0, r1 = window["ranks"]["0"], window["ranks"]["1"]
        assert r1["compute_s"] > 2.0 * r0["compute_s"]
        for r in waits:
            waits[r] += window["ranks"][r]["wait_s"]
    # over the windows (one window's medians can both be a few ms on a loaded machine,
    # when rank 0's own report reaches the next all_reduce late)
    assert waits["0"] > waits["1"], ev["evidence"]
    failed = _events(part, "instance_failed")
    assert [(e["kind"], e["rank"]) for e in failed] == [("straggler", 1)]
    assert _events(part, "recovery_finished")[0]["phases"]["standby_used"] is True
    restarted = [e for e in _events(part, "instance_started") if e["rank"] == 1]
    assert restarted[-1]["pid"] != part["slowed_pid"]
    assert part["summary"]["restarts"]["process"] == 1


@pytest.mark.slow
def test_hang_names_the_stacks_of_the_stuck_ranks(scenario):
    part = scenario["hang"]
    assert part["stopped_pid"], "the job never reached the step where rank 1 is stopped"
    assert part["summary"]["status"] == "succeeded", part["summary"]["error"]
    assert _events(part, "node_check") == []  # skip_node_check
    stacks = _events(part, "hang_stacks")
    assert len(stacks) == 1
    files = stacks[0]["files"]
    assert set(files) == {"trainer-0", "trainer-1"}, stacks[0]["errors"]
    texts = {label: open(path).read() for label, path in files.items()}
    # the stopped rank is caught somewhere in its loop; its peer waits in the collective
    assert f"pid {part['stopped_pid']}" in texts["trainer-1"]
    assert f"pid {part['rank0_pid']}" in texts["trainer-0"]
    assert "SyncSteps.run" in texts["trainer-1"]
    assert "all_reduce" in texts["trainer-0"]
    failed = _events(part, "instance_failed")[0]
    assert failed["kind"] == "hang"
    assert f"stacks: {files[failed['role'] + '-' + str(failed['rank'])]}" in failed["message"]


# ---------------------------------------------------------------- the pieces
def _result(node, gflops, pairs=()):
    r = NodeResult(node, gflops=gflops)
    r.pairs = [{"round": rnd, "peer": peer, "ok": bw is not None, "busbw_gbps": bw,
                "error": ""} for rnd, peer, bw in pairs]
    return r


def test_two_rounds_isolate_the_bad_node_of_a_pair():
    nodes = ["a", "b", "c", "d", "e"]
    pairs, odd = round1_pairs(nodes)
    assert pairs == [("a", "b"), ("c", "d")] and odd == ["e"]
    # round 1: c-d fails; e had no pair; round 2 pairs them with the good nodes
    assert round2_batches(["c", "d", "e"], ["a", "b"]) == [[("c", "a"), ("d", "b")],
                                                           [("e", "a")]]
    res = {"a": _result("a", 50, [(1, "b", 1.0), (2, "c", 1.0), (2, "e", 1.0)]),
           "b": _result("b", 52, [(1, "a", 1.0), (2, "d", None)]),
           "c": _result("c", 49, [(1, "d", None), (2, "a", 1.0)]),
           "d": _result("d", 51, [(1, "c", None), (2, "b", None)]),
           "e": _result("e", 48, [(2, "a", 1.0)])}
    judge(res, 2.0)
    assert {n: r.verdict for n, r in res.items()} == {
        "a": "ok", "b": "ok", "c": "ok", "d": "failed", "e": "ok"}


def test_verdicts_slow_compute_and_unverified():
    res = {"a": _result("a", 50, [(1, "b", None)]), "b": _result("b", 10, [(1, "a", None)]),
           "c": _result("c", 48)}
    judge(res, 2.0)  # c: odd one out with no good partner; a: its pair failed, no round 2
    assert res["b"].verdict == "slow_compute" and "slow_factor 2" in res["b"].reason
    assert res["a"].verdict == "unverified" and res["c"].verdict == "unverified"
    assert round2_batches(["a"], []) == []
    res["a"].no_answer = "its all-gather (round 1) did not return within 45 s"
    judge(res, 2.0)  # a probe stuck in its all-gather is the bad one of its pair
    assert res["a"].verdict == "failed" and res["a"].reason == res["a"].no_answer


def test_slow_ranks_compares_with_the_other_ranks():
    med = {0: {"compute_s": 0.10}, 1: {"compute_s": 0.35}, 2: {"compute_s": 0.11}}
    assert set(slow_ranks(med, 2.0)) == {1}
    assert slow_ranks({0: {"compute_s": 0.1}, 1: {"compute_s": 0.19}}, 2.0) == {}
    assert slow_ranks({0: {"compute_s": 0.1}}, 2.0) == {}


def _scope(action, emitted):
    spec = OmegaConf.create({"node_health": vars(NodeHealthSpec(
        straggler_action=action, straggler_window_s=1.0, straggler_windows=2))})
    inst = SimpleNamespace(node_id="n1", pid=42, last_step=7, attempt=0, state="running",
                           role="trainer", rank=1)
    return SimpleNamespace(spec=spec, failover=SimpleNamespace(last_recovery_end=0.0),
                           instances=SimpleNamespace(get=lambda role, rank: inst),
                           emit=lambda event, **f: emitted.append((event, f)))


def _windows(det, ratios, t0):
    found = []
    for i, ratio in enumerate(ratios):
        for _ in range(3):
            det.on_report("trainer", 0, i, {"compute_s": 0.1, "step_s": 0.1 * ratio})
            det.on_report("trainer", 1, i, {"compute_s": 0.1 * ratio, "step_s": 0.1 * ratio})
        found.append(det.check(now=t0 + 1.01 * (i + 1)))
    return found


def test_straggler_report_needs_consecutive_windows():
    emitted = []
    det = StragglerDetector(_scope("report", emitted))
    t0 = det._window_start
    assert _windows(det, [3, 1, 3, 3, 3, 3], t0) == [None] * 6
    detected = [f for e, f in emitted if e == "straggler_detected"]
    assert len(detected) == 1  # windows 3 and 4; not again while it stays slow
    assert detected[0]["rank"] == 1 and detected[0]["windows"] == 2
    assert detected[0]["evidence"][-1]["ranks"]["0"]["wait_s"] == pytest.approx(0.2)


def test_straggler_replace_returns_a_failure():
    emitted = []
    det = StragglerDetector(_scope("replace", emitted))
    found = _windows(det, [3, 3], det._window_start)
    assert found[0] is None and found[1] is not None
    assert found[1].failure.kind == "straggler" and found[1].failure.rank == 1


def test_a_restarted_master_can_still_take_back_the_nodes_a_check_excluded(tmp_path):
    """The check's exclusions live in the job's SQLite context beside ``failover``: a
    master that Ray restarts reads them back, so a later placement that needs them can
    still take them back. (Scope and failover are stand-ins; the context is real.)"""
    from dlrover_core.master.context import JobContext
    from dlrover_core.master.node_check import NodeCheck
    from dlrover_core.placement import PlacementError

    def master(emitted):
        bad: set[str] = set()
        failover = SimpleNamespace(bad_nodes=bad, snapshot=lambda: {"bad_nodes": sorted(bad)})
        scope = SimpleNamespace(context=JobContext(str(tmp_path / "context.sqlite")),
                                failover=failover, emit=lambda e, **f: emitted.append((e, f)))
        return NodeCheck(scope, launcher=None), scope

    first, _ = master([])
    assert first.excluded == set()
    first._exclude(["n1", "n2"])
    emitted: list = []
    second, scope = master(emitted)  # a new master process on the same job directory
    assert second.excluded == {"n1", "n2"}
    scope.failover.bad_nodes.update(scope.context.get("failover")["bad_nodes"])
    second._take_back(["n1"], PlacementError("the job needs 2 CPU"))
    assert scope.failover.bad_nodes == {"n2"} and scope.context.get("failover") == {
        "bad_nodes": ["n2"]}
    assert emitted == [("node_check_kept", {"nodes": ["n1"], "reason": "the job cannot be "
                                            "placed without them: the job needs 2 CPU"})]
    assert master([])[0].excluded == {"n2"}


@pytest.mark.parametrize("key,value", [("straggler_action", "shrink"),
                                       ("slow_factor", 1.0), ("matmul_size", 0),
                                       ("gpu_allgather_mb", 0), ("gpu_warmup_iters", 0),
                                       ("stack_dump", "gdb")])
def test_spec_rejects_bad_node_health(key, value):
    from dlrover_core import DLJobBuilder

    b = (DLJobBuilder().name("x").workload("trainer", "tests.workloads", "Echo").end()
         .node_health(**{key: value}))
    with pytest.raises(SpecError, match=f"node_health.{key}"):
        b.build()
    assert DLJobBuilder().name("x").workload("trainer", "tests.workloads", "Echo").end() \
        .skip_node_check().build().spec.node_health.skip_node_check is True


def test_py_spy_dump_names_what_a_loader_worker_is_stuck_in(tmp_path):
    """A rank that waits forever for a batch: the stack that explains it is the loader
    worker's (a forked child), so the dump holds the children's stacks too."""
    if py_spy() is None:
        pytest.skip("py-spy is not installed (pip install dlrover-core[diagnose])")
    code = textwrap.dedent("""
        import multiprocessing as mp, time
        def worker_stuck_here():
            while True:
                time.sleep(0.05)
        def parent_waits_here(child):
            print(child.pid, flush=True)
            child.join()
        if __name__ == "__main__":
            child = mp.get_context("fork").Process(target=worker_stuck_here, daemon=True)
            child.start()
            parent_waits_here(child)
    """)
    script = tmp_path / "stuck.py"
    script.write_text(code)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(p.stdout.readline())
        time.sleep(0.5)  # both in their loops
        out = dump_stacks(p.pid, "py-spy", str(tmp_path), timeout_s=20)
    finally:
        p.kill()
        p.wait()
        if child_pid is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except OSError:  # already gone with its parent
                pass
    assert out["method"] == "py-spy", out
    text = out["text"]
    parent, _, rest = text.partition(f"# child process {child_pid} (parent {p.pid})")
    assert "parent_waits_here" in parent and "worker_stuck_here" not in parent, text
    assert "worker_stuck_here" in rest, text


def test_faulthandler_dump_of_a_busy_process(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from dlrover_core.runtime.stack_dump import register
        register({str(tmp_path)!r})
        def spin_here():
            print("ready", flush=True)  # from inside: a dump after it shows this frame
            while True:
                pass
        spin_here()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        out = dump_stacks(p.pid, "faulthandler", str(tmp_path), timeout_s=5)
        assert out["method"] == "faulthandler" and "spin_here" in out["text"], out
        assert os.path.exists(faulthandler_path(str(tmp_path), p.pid))
    finally:
        p.kill()
        p.wait()
    gone = dump_stacks(p.pid, "faulthandler", str(tmp_path), timeout_s=1)
    assert gone["text"] == "" and gone["error"].startswith("kill:")
