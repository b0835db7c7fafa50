"""Every collective of the Megatron example gets tensors on the backend's device (NCCL
reduces only CUDA tensors: a CPU tensor there fails at TP >= 2 or DP >= 2).

``torch.distributed``'s collectives are wrapped
(``dlrover_core.testing.check_collective_devices``) to fail when a tensor is not on
``backend.device``. On the CPU the collectives run for real over a one-process gloo
group. The GPU case is faked, since this machine has no CUDA: the device the GPU path
would use is stood in for by ``meta`` (a device that is not the CPU and needs no
hardware); the wrapper checks the device and skips the communication (meta tensors
have no data), and the function then stops where it reads a value back
(``Tensor.item()`` on meta), after all its collectives ran. megatron-core's
``parallel_state`` sizes are faked too (TP = PP = DP = 2, every group the one-process
group) so that every collective of the functions is called.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from dlrover_core.testing import check_collective_devices
from examples.megatron_gpt import workload as wl

META = torch.device("meta")  # stands in for cuda:<i>: no CUDA here


@pytest.fixture
def collectives(gloo, monkeypatch):
    """The collectives wrapped by :func:`check_collective_devices`; returns its state:
    ``expected`` (the device) and ``seen`` (one list of device names per call)."""
    from megatron.core import parallel_state as ps

    for name in ("get_tensor_model_parallel_world_size",
                 "get_pipeline_model_parallel_world_size"):
        monkeypatch.setattr(ps, name, lambda: 2)
    for name in ("get_tensor_model_parallel_group", "get_pipeline_model_parallel_group",
                 "get_data_parallel_group"):
        monkeypatch.setattr(ps, name, lambda **kw: dist.group.WORLD)
    state = {"expected": torch.device("cpu"), "seen": []}
    check_collective_devices(state, monkeypatch.setattr)
    return state


def _model(device):
    m = torch.nn.Linear(3, 2).to(device)
    m.weight.tensor_model_parallel = True   # a TP-split weight and a replicated bias
    m.weight.grad = torch.full_like(m.weight, 2.0)
    m.bias.grad = torch.full_like(m.bias, 1.0)
    return m


def _eval_self(device):
    class Loss(torch.nn.Module):
        def forward(self, x, y):
            return (x.float() - y.float()).pow(2).mean()

    return types.SimpleNamespace(
        config={"eval_batches": 2}, model=Loss(), pp=1,
        backend=types.SimpleNamespace(device=device, dp_size=2),
        _batch=lambda split, i, seed: (torch.ones(2, 4, device=device),
                                       torch.zeros(2, 4, device=device)))


def test_on_gloo_every_collective_is_on_the_cpu(collectives):
    cpu = torch.device("cpu")
    # squares: TP-split 6 x 4 = 24, reduced over TP (one process: x1); replicated 2
    norm = wl._clip_grad_norm(_model(cpu), 100.0, cpu)
    assert norm == pytest.approx(26 ** 0.5)
    assert wl._num_params(_model(cpu), cpu) == 2 * 6 + 2   # the TP-split weight x TP=2
    # mean loss 1.0 per batch, all-reduced over DP (x1) then divided by dp_size 2
    assert wl.MegatronGPTWorkload.evaluate(_eval_self(cpu)) == pytest.approx(0.5)
    assert collectives["seen"] == [["cpu"]] * 4


@pytest.mark.parametrize("fn,calls", [
    (lambda: wl._clip_grad_norm(_model(META), 1.0, META), 2),   # TP sum, PP sum
    (lambda: wl._num_params(_model(META), META), 1),            # PP sum
    (lambda: wl.MegatronGPTWorkload.evaluate(_eval_self(META)), 1),  # DP mean
])
def test_gpu_path_collectives_are_on_the_backend_device(collectives, fn, calls):
    collectives["expected"] = META
    with pytest.raises(RuntimeError, match="meta tensors"):   # reading the value back
        fn()
    assert collectives["seen"] == [["meta"]] * calls
