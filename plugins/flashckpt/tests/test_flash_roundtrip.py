"""Bit-exact round trips of real training state through the flash saver: DDP and FSDP2
(2 ranks, gloo) and DeepSpeed ZeRO-2 (2 ranks, gloo, CPU). Each trainer is a real
WorkloadHost actor; "restart" means killing the actors and starting new ones that
load from shared memory, then (buffers removed, as after a node loss) from disk."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from dlrover_core.testing import spawn_role
from dlrover_plugin_flashckpt import hygiene, shm
from dlrover_plugin_flashckpt.persister import finish_job


@pytest.fixture
def job(ray_cluster):
    name = f"flashrt-{uuid.uuid4().hex[:8]}"
    yield name
    finish_job(name, timeout=30)
    assert not shm.list_segments("/dev/shm", shm.job_prefix(name))


def call(handles, method, *args):
    return ray.get([h.call.remote(method, *args) for h in handles])


def kill(handles):
    for h in handles:
        ray.kill(h, no_restart=True)


def assert_same(a: list[dict], b: list[dict]) -> None:
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), rank
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (rank, k)
            else:
                assert x[k] == y[k], (rank, k)


def round_trip(job: str, workload: str, backend: str, config: dict) -> None:
    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    call(hs, "train", 3)
    call(hs, "save", 3)
    saved = call(hs, "flat_state")
    call(hs, "wait")
    continued = call(hs, "train", 2)  # the reference run goes on from step 3
    kill(hs)

    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    assert call(hs, "load") == [{"step": 3, "source": "memory"}] * 2
    assert_same(call(hs, "flat_state"), saved)
    assert call(hs, "train", 2) == continued  # same losses, bit for bit
    kill(hs)

    hygiene.remove_job("/dev/shm", job)  # as after a node loss: only the disk is left
    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    assert call(hs, "load") == [{"step": 3, "source": "disk"}] * 2
    assert_same(call(hs, "flat_state"), saved)
    assert call(hs, "train", 2) == continued
    kill(hs)


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_torch_state_round_trip(job, tmp_path, backend):
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}
    round_trip(job, "dlrover_plugin_flashckpt.testing_workloads:TorchTrainer", backend,
               {"ckpt": ckpt})


def test_deepspeed_zero2_round_trip(job, tmp_path):
    pytest.importorskip("deepspeed")
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}
    round_trip(job, "dlrover_plugin_flashckpt.testing_workloads:ZeroTrainer", "deepspeed",
               {"ckpt": ckpt, "stage": 2})
