"""Every collective of the core's training helper and of the nanoGPT example gets
tensors on the device the rank computes on (NCCL reduces only CUDA tensors: a CPU
tensor there fails on GPUs with two or more ranks).

Two real gloo ranks (spawned processes) call ``runtime.elastic.accumulation_step`` and
``examples.nanogpt``'s ``GPTWorkload.evaluate`` with ``torch.distributed``'s collectives
wrapped to fail when a tensor is not on the expected device
(``dlrover_core.testing.check_collective_devices``). On the CPU the collectives run
for real, and the returned means are the two ranks' average. The GPU case is faked,
since this machine has no CUDA: ``meta`` stands in for ``cuda:<i>`` (not the CPU, no
hardware needed); the wrapper checks the device and skips the communication (meta
tensors have no data), and the function then stops where it reads the value back
(``Tensor.item()`` on meta), after its collective ran.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from dlrover_core.testing import check_collective_devices, end_rank_process

META = torch.device("meta")  # stands in for cuda:<i>: no CUDA here
CPU = torch.device("cpu")


def _accumulate(rank: int, device: torch.device) -> float:
    """Two micro-batches whose loss is ``(rank + 1) ** 2`` each (weight 0, target r+1)."""
    from dlrover_core.runtime.elastic import accumulation_step

    model = torch.nn.Linear(1, 1, bias=False).to(device)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(2, 1, device=device)
    y = torch.full((2, 1), float(rank + 1), device=device)
    return accumulation_step(model, opt, [(x, y), (x, y)],
                             lambda m, b: (m(b[0]) - b[1]).pow(2).mean())


def _nanogpt_eval(rank: int, device: torch.device) -> float:
    """``GPTWorkload.evaluate`` of a stand-in model whose loss is ``rank + 1``."""
    from examples.nanogpt.workload import GPTWorkload

    class Model(torch.nn.Module):
        def forward(self, x, y):
            return None, y.float().mean()

    data = types.SimpleNamespace(
        batch=lambda split, bs, block, seed, r, i: (torch.zeros(bs, block, dtype=torch.long),
                                                    torch.full((bs, block), rank + 1)))
    fake = types.SimpleNamespace(
        config=OmegaConf.create({"eval_batches": 2, "batch_size": 2}), data=data,
        cfg=types.SimpleNamespace(block_size=4), model=Model(), rank=rank, world_size=2,
        backend=types.SimpleNamespace(device=device))
    return GPTWorkload.evaluate(fake)


def _rank(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)
    out = {}
    state: dict = {}
    check_collective_devices(state)
    for name, fn in (("accumulation_step", _accumulate), ("nanogpt_evaluate", _nanogpt_eval)):
        state.update(expected=CPU, seen=[])
        value = fn(rank, CPU)
        state["expected"] = META
        try:
            fn(rank, META)
            meta_error = ""
        except RuntimeError as exc:  # reading a meta value back, after the collective
            meta_error = str(exc)
        out[name] = {"value": value, "seen": state["seen"], "meta_error": meta_error}
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    mp.start_processes(_rank, args=(str(out / "pg"), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("name,mean", [
    ("accumulation_step", (1.0 + 4.0) / 2),   # losses 1 and 4, averaged over the ranks
    ("nanogpt_evaluate", (1.0 + 2.0) / 2),    # losses 1 and 2
])
def test_collectives_on_gloo_run_on_the_cpu_and_on_the_gpu_path_on_its_device(
        results, name, mean):
    for rank in (0, 1):
        got = results[rank][name]
        assert got["value"] == pytest.approx(mean)
        # one all_reduce on the CPU, then one on the faked GPU device
        assert got["seen"] == [["cpu"], ["meta"]]
        assert "meta tensors" in got["meta_error"]
