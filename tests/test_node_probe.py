"""The node check's probes (``dlrover_core.runtime.node_probe``) and what the check
makes of several probes per node (``dlrover_core.master.node_check``): which bundles
are probed, a node judged by its slowest device, the sizes of the spec per device
kind, and the probes' own code on this machine (the CPU path, real gloo all-gathers
between two processes). The CUDA path runs only where CUDA is (``gpu``-marked: ``make
gpu-check``); the whole check on a real cluster is ``tests/test_node_health.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrover_core.master.node_check import NodeResult, judge, probe_bundles
from dlrover_core.runtime.node_probe import NodeProbe, local_check, probe_sizes
from dlrover_core.spec.node_health import NodeHealthSpec


def test_every_gpu_bundle_is_probed_and_one_bundle_of_a_cpu_node():
    pg1, pg2 = object(), object()
    cpu, gpu = {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}
    got = probe_bundles([("a", pg1, 0, gpu), ("a", pg1, 1, gpu), ("a", pg1, 1, gpu),
                         ("b", pg1, 2, cpu), ("b", pg1, 3, cpu),
                         ("c", pg2, 0, cpu), ("c", pg2, 1, gpu)])
    assert [(b[0] is pg1, b[1]) for b in got["a"]] == [(True, 0), (True, 1)]
    assert [b[1] for b in got["b"]] == [2]  # CPUs: one probe for the node
    assert [(b[0] is pg2, b[1]) for b in got["c"]] == [(True, 1)]  # its GPU, not its CPU


def test_a_node_is_judged_by_its_slowest_device():
    def node(nid, flops):
        return NodeResult(nid, gflops=min(flops), devices=[
            {"bundle": i, "gflops": f} for i, f in enumerate(flops)])

    # b has one GPU at a third of the others; its median is still high
    res = {"a": node("a", [300.0, 310.0, 305.0, 299.0]),
           "b": node("b", [300.0, 100.0, 310.0, 305.0]),
           "c": node("c", [302.0, 298.0, 301.0, 300.0])}
    judge(res, 2.0)
    assert res["b"].verdict == "slow_compute" and "nodes' devices" in res["b"].reason
    assert "slow_compute" not in (res["a"].verdict, res["c"].verdict)  # (no pairs here)


def test_the_spec_s_sizes_per_device_kind():
    spec = NodeHealthSpec()
    gpu, cpu = probe_sizes(spec, gpu=True), probe_sizes(vars(spec), gpu=False)
    assert gpu["matmul"] == {"size": 2048, "iters": 200, "batch": 10, "warmup": 20}
    assert gpu["allgather_kb"] == 64 * 1024 and gpu["allgather_iters"] == 40
    assert cpu["matmul"] == {"size": 256, "iters": 20, "batch": 1, "warmup": 1}
    assert cpu["allgather_kb"] == 1024 and cpu["warmup"] == 1


def test_the_cpu_probe_runs_the_batched_matmul():
    res = NodeProbe(device="cpu").matmul(size=32, iters=3, batch=2, warmup=1)
    assert res["device"] == "cpu" and res["dtype"] == "float32"
    assert res["seconds"] > 0
    assert res["gflops"] == pytest.approx(2 * 32 ** 3 * 2 * 3 / res["seconds"] / 1e9)


def test_the_local_check_on_this_machine_cpu_path():
    """``make gpu-check``'s first part, on the CPU: the same probes, small sizes; the
    all-gather between two processes checks the data it gets back."""
    out = subprocess.run([sys.executable, "-m", "dlrover_core.runtime.node_probe", "--cpu",
                          "--timeout-s", "60", "--set", "matmul_size=64",
                          "--set", "allgather_kb=256"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["device"] == "cpu" and res["sizes"]["matmul"]["size"] == 64
    assert [d["device"] for d in res["devices"]] == ["cpu"] and res["devices"][0]["gflops"] > 0
    assert [p["ok"] for p in res["pairs"]] == [True] and res["pairs"][0]["busbw_gbps"] > 0


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="node_health.matmul_sise: unknown size; allowed:"):
        local_check(cpu=True, options={"matmul_sise": 64})
    with pytest.raises(ValueError, match="node_health.matmul_size: 0 is invalid"):
        local_check(cpu=True, options={"matmul_size": 0})


@pytest.mark.gpu
def test_every_local_gpu_is_probed_with_cuda_events():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = local_check(timeout_s=120)
    n = torch.cuda.device_count()
    assert res["device"] == "cuda" and len(res["devices"]) == n
    assert all(d["dtype"] == "bfloat16" and d["gflops"] > 0 for d in res["devices"])
    assert len(res["pairs"]) == n // 2  # GPUs 0-1, 2-3, ...
    assert all(p["ok"] and p["busbw_gbps"] > 0 for p in res["pairs"]), res["pairs"]


@pytest.mark.slow  # a Ray cluster and 4 probes importing torch: 20 s here, more when busy
def test_the_check_probes_every_gpu_bundle_of_every_node():
    """Two ``cluster_utils`` nodes declaring 2 GPUs each (declared only: no GPU here, so
    each probe takes its CPU path, gloo), a placement of 4 one-GPU bundles (2 per
    node): the check runs 4 probes, each node reports 2 devices, and the pair's
    all-gather runs on both links (GPU 0 with GPU 0, GPU 1 with GPU 1)."""
    from types import SimpleNamespace

    import ray
    from omegaconf import OmegaConf

    from dlrover_core.master.node_check import NodeCheck
    from dlrover_core.testing import multinode_cluster

    # multinode_cluster leaves the shared test cluster first: joining by init_ray alone
    # would keep an earlier module's connection, where no GPU is declared (a CI failure)
    with multinode_cluster(workers=2, cpus=1, gpus=2):
        pg = ray.util.placement_group([{"CPU": 0.25, "GPU": 1}] * 4, strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        where = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        nodes = probe_bundles([(where[i], pg, i, {"CPU": 0.25, "GPU": 1.0})
                               for i in range(4)])
        assert sorted(len(b) for b in nodes.values()) == [2, 2]
        events: list = []
        # slow_factor 1000: 4 probes share 2 busy cores; speed is not what this tests
        spec = OmegaConf.create({"node_health": vars(NodeHealthSpec(
            matmul_size=64, allgather_kb=64, check_timeout_s=60, slow_factor=1000.0))})
        scope = SimpleNamespace(spec=spec, name="probe-test",
                                context=SimpleNamespace(get=lambda key: None),
                                emit=lambda event, **f: events.append((event, f)))
        results = NodeCheck(scope, launcher=None).check(nodes)
    [(name, ev)] = events
    assert name == "node_check" and ev["probes"] == 4
    for node, r in results.items():
        assert sorted(d["bundle"] for d in r.devices) == sorted(b[1] for b in nodes[node])
        assert all(d["gflops"] > 0 for d in r.devices)
        assert r.gflops == pytest.approx(min(d["gflops"] for d in r.devices), rel=1e-3)
        assert [(p["round"], p["ok"], p["links"]) for p in r.pairs] == [(1, True, 2)], r.pairs
        assert r.verdict == "ok", r.reason
