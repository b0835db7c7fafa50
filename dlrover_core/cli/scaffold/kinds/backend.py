"""The ``backend`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

_BACKEND_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` SPMD backend.

Imports nothing heavy: the session class is named by its import path and imported in
the worker process that uses it.
"""

from __future__ import annotations

from dlrover_core import Backend, hookimpl


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [Backend(name="__NAME__", session="__PKG__.session:__CLASS__Session",
                    state_dict_engine="plain",
                    description="DistributedDataParallel on the role's process group")]
'''

_BACKEND_SESSION = '''\
"""The worker-side half of the ``__NAME__`` backend.

``TorchDistributedSession`` (dlrover-core) joins the role's torch.distributed group at
its rendezvous (gloo on the CPU, NCCL on GPUs, ``failover.pg_timeout_s`` as the
collective timeout); this subclass decides how a model is wrapped. Change ``wrap``
(and ``setup`` for another runtime) to make it your backend.
"""

from __future__ import annotations

from typing import Any

import torch

from dlrover_core import BackendSession  # noqa: F401  (the base of every session)
from dlrover_core.runtime.backend import TorchDistributedSession


class __CLASS__Session(TorchDistributedSession):
    def wrap(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """``DistributedDataParallel`` over the role's group; ``kwargs`` go to DDP.
        One rank: the model on this rank's device, unwrapped."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if self.context.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kwargs)
'''

_BACKEND_WORKLOADS = '''\
"""A workload that checks the backend: its process group and its model wrapping."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload


class Probe(BaseWorkload):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = self.backend.wrap(torch.nn.Linear(4, 1))

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([float(value)], device=self.backend.device)
        dist.all_reduce(t)
        return t.item()

    def weight_grad(self) -> list:
        """Gradient of sum(model(x)) for x filled with rank + 1 (2 samples): each rank's
        own gradient is 2 * (rank + 1); data parallelism averages it over the ranks."""
        x = torch.full((2, 4), float(self.rank + 1))
        self.model(x).sum().backward()
        module = getattr(self.model, "module", self.model)
        return module.weight.grad.tolist()
'''

_BACKEND_TEST = '''\
"""The ``__NAME__`` backend on two real ranks (gloo) in Ray actors."""

from __future__ import annotations

import pytest
import ray

from dlrover_core.testing import spawn_role


@pytest.fixture
def ranks(ray_cluster):
    handles = spawn_role("trainer", "tests.workloads:Probe", 2, backend="__NAME__",
                         job="__NAME__-test")
    yield handles
    for h in handles:
        ray.kill(h)


def test_process_group_joins_both_ranks(ranks):
    sums = ray.get([h.call.remote("all_reduce", r + 1) for r, h in enumerate(ranks)])
    assert sums == [3.0, 3.0]


def test_wrapped_model_averages_gradients(ranks):
    grads = ray.get([h.call.remote("weight_grad") for h in ranks])
    # rank 0 alone: 2.0, rank 1 alone: 4.0 -> averaged: 3.0 on both ranks
    assert grads[0] == grads[1] == [[3.0, 3.0, 3.0, 3.0]]


def test_registered_record(plugin_manager):
    backend = plugin_manager.get_backend("__NAME__")
    assert backend.provider == "__NAME__"
    assert backend.session == "__PKG__.session:__CLASS__Session"
'''

BACKEND = Kind(
    name="backend", summary="An SPMD backend: process group setup and model wrapping",
    provides=("backend:__NAME__",), hooks=("dlrover_backends",), deps=("torch>=2.4",),
    files={"__PKG__/plugin.py": _BACKEND_PLUGIN, "__PKG__/session.py": _BACKEND_SESSION,
           "tests/workloads.py": _BACKEND_WORKLOADS, "tests/test___NAME__.py": _BACKEND_TEST},
    layout=(("__PKG__/session.py", "`__CLASS__Session`: joins the role's process group "
             "and wraps models"),),
    usage="In a job spec: `roles.<role>.backend: __NAME__`; a workload gets the session as "
          "`self.backend` (`self.backend.wrap(model)`, `self.backend.device`).\n")
