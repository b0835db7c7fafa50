"""Bit-exact round trips of real training state through the flash saver: DDP and FSDP2
(2 ranks, gloo) and DeepSpeed ZeRO-2 (2 ranks, gloo, CPU). Each trainer is a real
WorkloadHost actor; "restart" means killing the actors and starting new ones that
load from shared memory, then (buffers removed, as after a node loss) from disk."""

from __future__ import annotations

import pytest

from dlrover_core.testing import assert_states_equal, call_all, kill_actors, spawn_role
from dlrover_plugin_flashckpt import hygiene


def round_trip(job: str, workload: str, backend: str, config: dict) -> None:
    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    call_all(hs, "train", 3)
    call_all(hs, "save", 3)
    saved = call_all(hs, "flat_state")
    call_all(hs, "wait")
    continued = call_all(hs, "train", 2)  # the reference run goes on from step 3
    kill_actors(hs)

    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    assert call_all(hs, "load") == [{"step": 3, "source": "memory"}] * 2
    assert_states_equal(call_all(hs, "flat_state"), saved)
    assert call_all(hs, "train", 2) == continued  # same losses, bit for bit
    kill_actors(hs)

    hygiene.remove_job("/dev/shm", job)  # as after a node loss: only the disk is left
    hs = spawn_role("trainer", workload, 2, config, backend=backend, job=job)
    assert call_all(hs, "load") == [{"step": 3, "source": "disk"}] * 2
    assert_states_equal(call_all(hs, "flat_state"), saved)
    assert call_all(hs, "train", 2) == continued
    kill_actors(hs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_torch_state_round_trip(job, tmp_path, backend):
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}
    round_trip(job, "plugins.flashckpt.tests.flash_workloads:TorchTrainer", backend,
               {"ckpt": ckpt})


@pytest.mark.slow
def test_deepspeed_zero2_round_trip(job, tmp_path):
    pytest.importorskip("deepspeed")
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}
    round_trip(job, "plugins.flashckpt.tests.flash_workloads:ZeroTrainer", "deepspeed",
               {"ckpt": ckpt, "stage": 2})
