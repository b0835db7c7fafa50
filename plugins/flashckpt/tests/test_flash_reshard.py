"""A flash checkpoint of 2 FSDP2 ranks (gloo, real WorkloadHost actors) restored into
1 and 4 ranks, from shared memory and from disk: every rank ends with the full model
and optimizer state that was saved, and trains on."""

from __future__ import annotations

import pytest
import torch

from dlrover_core.testing import call_all, kill_actors, spawn_role
from dlrover_plugin_flashckpt import hygiene

WORKLOAD = "plugins.flashckpt.tests.flash_workloads:TorchTrainer"


def assert_full_equal(got: dict, want: dict) -> None:
    """``got`` (a new rank's full state) equals ``want`` (the saved full state) in
    every model and optimizer tensor and value; ``extra`` is the base rank's."""
    keys = [k for k in want if not k.startswith(".extra")]
    assert sorted(k for k in got if not k.startswith(".extra")) == sorted(keys)
    assert any(".exp_avg_sq" in k for k in keys)  # the optimizer state is there
    for k in keys:
        if isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        else:
            assert got[k] == want[k], k


def restore(job: str, config: dict, world: int, source: str, saved: list[dict],
            save_after: bool = False) -> None:
    hs = spawn_role("trainer", WORKLOAD, world, config, backend="fsdp", job=job)
    try:
        assert call_all(hs, "load", 3) == [{"step": 3, "source": source}] * world
        full = call_all(hs, "full_state")
        for rank, got in enumerate(full):
            assert_full_equal(got, saved[0])
            base = saved[rank % 2]
            assert torch.equal(got[".extra.rng"], base[".extra.rng"])
            assert got[".extra.step"] == 3
        losses = call_all(hs, "train", 1)  # the restored state trains on
        assert all(len(x) == 1 and x[0] == x[0] for x in losses)
        if save_after:  # ... and saves in the new world size (the old ranks are forgotten)
            call_all(hs, "save", 4)
            call_all(hs, "wait")
            assert call_all(hs[:1], "saver_info")[0]["committed"] == [3, 4]
    finally:
        kill_actors(hs)


def save_two_ranks(job: str, config: dict) -> list[dict]:
    hs = spawn_role("trainer", WORKLOAD, 2, config, backend="fsdp", job=job)
    call_all(hs, "train", 3)
    call_all(hs, "save", 3)
    saved = call_all(hs, "full_state")
    call_all(hs, "wait")
    kill_actors(hs)
    assert torch.equal(saved[0][".model.head.weight"], saved[1][".model.head.weight"])
    return saved


@pytest.mark.slow
def test_two_ranks_restore_into_four_from_memory_and_one_from_disk(job, tmp_path):
    config = {"ckpt": {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}}
    saved = save_two_ranks(job, config)
    restore(job, config, 4, "memory-resharded", saved, save_after=True)
    hygiene.remove_job("/dev/shm", job)  # as after a node loss: only the disk is left
    restore(job, config, 1, "disk-resharded", saved)  # step 3, saved by 2 ranks


@pytest.mark.slow
def test_two_ranks_restore_into_one_from_memory_and_four_from_disk(job, tmp_path):
    config = {"ckpt": {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}}
    saved = save_two_ranks(job, config)
    restore(job, config, 1, "memory-resharded", saved, save_after=True)
    hygiene.remove_job("/dev/shm", job)
    restore(job, config, 4, "disk-resharded", saved)
