"""The API as DLRover has it now (issue 22): ``submit()`` returns the exit code and
prints a failure, ``device_type``, ``global_env`` in every process, non-blocking calls
that ``ray.get`` / ``ray.wait`` take, and ``node_num`` spreading a role over nodes."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core import DLJobBuilder, SpecError
from tests.api_programs import ENV_KEY
from tests.scenarios import run_scenario


def _probe_job(devices: int = 2):
    return (DLJobBuilder().dl_type("SFT").node_num(1).device_per_node(devices)
            .skip_node_check().failover(standby=False)
            .trainer("tests.api_programs", "ProbeTrainer")
            .workload("tests.api_programs", "ProbeWorkload").total(2).per_node(2)
            .resource(cpu=1))


def test_failed_submit_prints_the_error_and_returns_the_exit_code(ray_cluster, tmp_path,
                                                                   capsys):
    """device_type GPU (the default) with device_per_node(2) on this GPU-less cluster:
    refused before any actor starts; submit prints why and returns 1."""
    job = _probe_job().build()
    rc = job.submit(job_dir=str(tmp_path / "job"))
    assert rc == 1 and isinstance(rc, int)
    assert rc["status"] == "failed" and rc.summary["status"] == "failed"
    err = capsys.readouterr().err
    assert (f"job {job.name} failed: " in err and "the job needs 2 GPU in all but the "
            "cluster has 0" in err and "(exit code 1)" in err), err
    assert not os.path.exists(tmp_path / "job" / "probe.json")  # nothing ran


def test_cpu_devices_global_env_and_drefs(ray_cluster, tmp_path, capsys):
    """device_type CPU runs the same program; global_env is seen by both workload
    processes and the driver; a non-blocking call's DRef goes to ray.get/ray.wait."""
    job = _probe_job().device_type("CPU").global_env({ENV_KEY: "on-every-process"}).build()
    assert job.spec.roles.trainer.resources.gpu == 0.0
    rc = job.submit(job_dir=str(tmp_path / "job"))
    assert rc == 0, rc.get("error")
    assert capsys.readouterr().err.count("failed") == 0
    out = json.load(open(tmp_path / "job" / "probe.json"))
    assert out["driver"]["env"] == "on-every-process"
    assert [r["env"] for r in out["ranks"]] == ["on-every-process"] * 2
    pids = {out["driver"]["pid"]} | {r["pid"] for r in out["ranks"]}
    assert len(pids) == 3 and os.getpid() not in pids    # three processes of their own
    assert out["is_list"] and out["get"] == [10, 11] and out["wait"] == [2, 0]


def test_device_type_is_checked():
    with pytest.raises(SpecError, match=r"device_type: 'TPU' is invalid; allowed: CPU or GPU"):
        DLJobBuilder().device_type("TPU")
    b = _probe_job(devices=1).device_type("cpu")
    with pytest.raises(SpecError, match=r"2 instances x resources.cpu=1 need 2 CPUs on one "
                                        r"node\); allowed: at most device_per_node=1 CPUs"):
        b.build()


@pytest.mark.slow  # a several-node scenario in a subprocess: ~10 s
def test_node_num_spreads_the_role_over_nodes(tmp_path):
    """node_num(2), total 2, per_node unset, on 2 worker nodes of 2 CPUs each: before,
    both ranks packed onto one node (it fits); now one rank on each node."""
    job_dir = tmp_path / "job"
    res = run_scenario("node_num", job_dir, timeout=300)
    assert res["rc"] == 0, res["error"]
    nodes = [r["node"] for r in res["probe"]["ranks"]]
    assert sorted(nodes) == sorted(res["workers"]), (nodes, res["workers"])


def test_node_num_plan_is_strict_spread():
    from dlrover_core.builtin.placement import plan_pack
    from dlrover_core.graph.graph import ComputationGraph
    from dlrover_core.placement import ClusterResources, NodeResources, PlacementError
    from dlrover_core.spec.loader import load_spec

    spec = load_spec({"name": "n", "node_num": 2, "roles": {"t": {"workload": "m.w:W",
                                                                   "total": 4}}},
                     ["template=null"])
    assert spec.roles.t.per_node == 2
    cluster = ClusterResources([NodeResources(str(i), "", {"CPU": 2.0}) for i in range(2)])
    plan = plan_pack(ComputationGraph.from_spec(spec), cluster)
    assert [(g.strategy, g.bundles) for g in plan.groups] == [
        ("STRICT_SPREAD", [{"CPU": 2.0}, {"CPU": 2.0}])]
    assert [plan.slots[("t", r)].bundle for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(PlacementError, match=r"spreads over 2 nodes \(node_num\) with "
                                             r"\{'CPU': 2.0\} on each, but only 1 node"):
        plan_pack(ComputationGraph.from_spec(spec),
                  ClusterResources([NodeResources("0", "", {"CPU": 4.0})]))
