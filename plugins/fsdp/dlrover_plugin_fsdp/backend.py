"""Backend sessions: join the role's process group, wrap models.

The process group is created from the role's rendezvous (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) with ``init_method=tcp://`` and the
job's ``failover.pg_timeout_s``. The device is ``cuda:<LOCAL_RANK % visible>``
with NCCL when CUDA is available, else the CPU with gloo.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from dlrover_core.runtime.backend import BackendSession


class TorchDistSession(BackendSession):
    """Common process-group handling of the torch backends."""

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def dist_backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"

    def setup(self) -> None:
        ctx = self.context
        if torch.cuda.is_available():
            torch.cuda.set_device(ctx.local_rank % torch.cuda.device_count())
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=float(ctx.failover.get("pg_timeout_s", 120)))
        dist.init_process_group(
            self.dist_backend, init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}",
            rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)

    def teardown(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be destroyed
                pass


class DDPSession(TorchDistSession):
    def wrap(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """``DistributedDataParallel`` over the role's group (``kwargs`` go to DDP)."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if self.context.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kwargs)


class FSDPSession(TorchDistSession):
    def wrap(self, model: torch.nn.Module, shard_modules: tuple[type, ...] | None = None,
             **kwargs: Any) -> torch.nn.Module:
        """FSDP2: ``fully_shard`` each submodule of a type in ``shard_modules`` (e.g. the
        transformer block class), then the root, on a 1-D DeviceMesh of the role's ranks.
        ``kwargs`` go to ``fully_shard`` (``reshard_after_forward``, ``mp_policy``...)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.context.world_size,))
        if shard_modules:
            for module in model.modules():
                if isinstance(module, shard_modules):
                    fully_shard(module, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        return model
