"""GPU-only checks (``gpu`` marker; skipped without CUDA; run by ``make gpu-check``):
a rank computes on the GPU Ray reserved for it, DDP and FSDP2 train on ``cuda`` over
NCCL, and the survivors' NCCL groups are aborted after a rank is SIGKILLed. The same
placement logic is tested without a GPU on fake-GPU Ray clusters
(tests/test_guide_api.py::test_gpus_from_the_spec, tests/test_gpu_standby.py)."""

from __future__ import annotations

import glob
import json
import os
import signal

import pytest
import ray
import torch

from dlrover_core import DLJobBuilder, load_spec
from dlrover_core.master.client import create_master
from dlrover_core.master.events import read_events
from dlrover_core.testing import poll_status

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
W = "tests.gpu_workloads"


def _gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def _run(builder, job_dir) -> tuple[dict, dict, dict]:
    summary = builder.build().submit(job_dir=str(job_dir))
    assert summary["status"] == "succeeded", summary.get("error")
    probes = {(p["role"], p["rank"]): p for p in
              (json.load(open(f)) for f in glob.glob(os.path.join(job_dir, "probe", "*.json")))}
    started = {(e["role"], e["rank"]): e for e in read_events(
        os.path.join(job_dir, "events.jsonl"))
        if e["event"] == "instance_started" and e["role"] != "driver"}
    return summary, probes, started


def test_placement_on_real_gpus(ray_cluster, tmp_path):
    """Each rank computes on the device of its event (``cuda_device``, its Ray GPU);
    collocated roles at 0.5 GPU share one physical GPU; separate roles (with >= 2
    GPUs) never do."""
    b = (DLJobBuilder().name("gpu-colloc").dl_type("SFT").config({"steps": 5})
         .workload("trainer", W, "CudaTrain").total(1).backend("ddp").resource(cpu=0.5, gpu=1)
         .workload("eval", W, "CudaTrain").total(1).backend("ddp").resource(cpu=0.5, gpu=1)
         .with_collocation("trainer", "eval"))
    _, probes, started = _run(b, tmp_path / "colloc")
    for key, p in probes.items():
        assert p["current_device"] == started[key]["cuda_device"] == p["cuda_device"]
        assert p["device"] == f"cuda:{p['cuda_device']}"
    assert probes[("trainer", 0)]["uuid"] == probes[("eval", 0)]["uuid"]
    if _gpus() < 2:
        return
    b = (DLJobBuilder().name("gpu-sep").dl_type("SFT").config({"steps": 5})
         .workload("trainer", W, "CudaTrain").total(1).backend("ddp").resource(cpu=0.5, gpu=1)
         .workload("eval", W, "CudaTrain").total(1).backend("ddp").resource(cpu=0.5, gpu=1))
    _, probes, _ = _run(b, tmp_path / "sep")
    assert probes[("trainer", 0)]["uuid"] != probes[("eval", 0)]["uuid"]


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_train_on_cuda(ray_cluster, tmp_path, backend):
    n = min(2, _gpus())
    b = (DLJobBuilder().name(f"gpu-{backend}").dl_type("SFT").config({"steps": 30})
         .workload("trainer", W, "CudaTrain").total(n).per_node(n).backend(backend)
         .resource(cpu=0.5, gpu=1))
    _, probes, _ = _run(b, tmp_path)
    assert len(probes) == n
    for p in probes.values():
        assert p["dist_backend"] == "nccl" and p["param_device"].startswith("cuda")
        assert sum(p["losses"][-5:]) < sum(p["losses"][:5])
    assert len({p["uuid"] for p in probes.values()}) == n   # one GPU per rank


def test_nccl_survivors_are_aborted_after_sigkill(ray_cluster, tmp_path):
    """Two nanoGPT ranks on two GPUs (NCCL refuses two ranks of a group on one GPU);
    rank 1 is SIGKILLed; the survivor's NCCL groups are aborted and the job recovers."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs: NCCL allows one rank of a group per GPU")
    s = load_spec("examples/nanogpt/job.yaml", [
        "name=gpu-nccl-abort", "roles.trainer.resources.gpu=1", "config.max_steps=60",
        "config.eval_every=60", "checkpoint.every_steps=10", "failover.standby=false",
        "failover.pg_timeout_s=60", "failover.survivor_grace_s=3"])
    job_dir = str(tmp_path)
    master = create_master(s, job_dir)
    ray.get(master.start.remote())
    st = poll_status(master, lambda st: st["step"] >= 12 or st["summary"], 240)
    assert not st["summary"]
    os.kill(st["instances"]["trainer-1"]["pid"], signal.SIGKILL)
    summary = poll_status(master, lambda st: st["summary"], 300)["summary"]
    ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary.get("error")
    rec = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
           if e["event"] == "recovery_finished"][0]
    assert rec["phases"]["survivor_abort"] == {"trainer-0": "aborted (nccl)"}
