"""Every collective of the multimodal trainer gets tensors on the device of its data
(NCCL reduces and gathers only CUDA tensors: a CPU tensor there fails with two or more
trainer ranks on GPUs).

``torch.distributed``'s collectives are wrapped
(``dlrover_core.testing.check_collective_devices``) to fail when a tensor (or a tensor
of a list argument) is not on the expected device. On the CPU the collectives run for
real over gloo: a one-process group for the trainer's fetch agreement, two spawned
processes for :func:`gather_features` (its shapes need two real ranks). The GPU case is
faked, since this machine has no CUDA: ``meta`` stands in for ``cuda:<i>`` (not the CPU,
no hardware needed); the wrapper checks the device and skips the communication (meta
tensors have no data), and the function then stops where it reads a value back
(``Tensor.item()`` on meta), after the collective ran. The world size the code sees is
faked to 2 there so that the collective is called at all.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrover_core.testing import check_collective_devices, end_rank_process
from dlrover_plugin_multimodal.contrastive import gather_features
from dlrover_plugin_multimodal.fusion import FusionTrainerWorkload, UpstreamLost

META = torch.device("meta")  # stands in for cuda:<i>: no CUDA here
CPU = torch.device("cpu")


@pytest.fixture
def collectives(gloo, monkeypatch):
    state = {"expected": CPU, "seen": []}
    check_collective_devices(state, monkeypatch.setattr)
    return state


class _Lost:
    """An encoder's output whose fetch fails (its process died)."""
    role, modality, payload = "image_encoder", "image", "embedding"

    def overlapping(self, start, stop):
        raise ConnectionError("encoder actor died")


def _trainer(device):
    """What ``FusionTrainerWorkload._fetch`` reads of its trainer: rank 0 of 2."""
    return types.SimpleNamespace(
        rank=0, world_size=2, mm=types.SimpleNamespace(fetch_timeout_s=5.0),
        backend=types.SimpleNamespace(device=device))


def test_fetch_agreement_on_gloo_is_on_the_cpu(collectives):
    batch = FusionTrainerWorkload._fetch(_trainer(CPU), [10, 11, 12, 13], {})
    assert batch["ids"].tolist() == [10, 11]   # rank 0's half of the step
    with pytest.raises(UpstreamLost, match="ConnectionError: encoder actor died"):
        FusionTrainerWorkload._fetch(_trainer(CPU), [10, 11, 12, 13], {"image": _Lost()})
    assert collectives["seen"] == [["cpu"]] * 2


def test_fetch_agreement_on_the_gpu_path_is_on_the_backend_device(collectives):
    collectives["expected"] = META
    with pytest.raises(RuntimeError, match="meta tensors"):   # reading the value back
        FusionTrainerWorkload._fetch(_trainer(META), [10, 11, 12, 13], {})
    assert collectives["seen"] == [["meta"]]


def test_gather_features_row_counts_are_on_the_features_device(collectives, monkeypatch):
    collectives["expected"] = META
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    a = torch.zeros(3, 4, device=META)
    with pytest.raises(RuntimeError, match="meta tensors"):   # comparing the row counts
        gather_features(a, a.clone())
    assert collectives["seen"] == [["meta"]]


def _gather_rank(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)
    state = {"expected": CPU, "seen": []}
    check_collective_devices(state)
    image = torch.full((2, 3), float(rank))
    text = torch.full((2, 3), 10.0 + rank)
    a, b = gather_features(image, text)
    dist.destroy_process_group()
    torch.save({"image": a, "text": b, "seen": state["seen"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


def test_gather_features_over_two_gloo_ranks_runs_every_collective_on_the_cpu(tmp_path):
    mp.start_processes(_gather_rank, args=(str(tmp_path / "pg"), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["seen"] == [["cpu"]] * 3   # row counts, image rows, text rows
        assert got["image"][:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
        assert got["text"][:, 0].tolist() == [10.0, 10.0, 11.0, 11.0]
