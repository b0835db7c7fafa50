"""Backend sessions ``ddp`` and ``fsdp``: the role's process group comes from
``TorchDistributedSession`` (gloo on the CPU, NCCL on GPU); these wrap models."""

from __future__ import annotations

from typing import Any

import torch

from dlrover_core.runtime.backend import TorchDistributedSession


class DDPSession(TorchDistributedSession):
    #: every rank holds the whole model and optimizer: a replaced rank heals from a
    #: survivor's live state, with no step redone (``dlrover_core.checkpoint.heal``)
    replicated_state = True

    def wrap(self, model: torch.nn.Module, measure_comm_wait: bool = True,
             **kwargs: Any) -> torch.nn.Module:
        """``DistributedDataParallel`` over the role's group (``kwargs`` go to DDP).

        With ``measure_comm_wait`` (default), DDP's gradient all-reduce runs through
        ``dlrover_core.tuning.metrics.measure_comm_wait``'s hook (the same mean
        all-reduce, timed): every step report of this rank then carries its
        ``comm_wait_s`` and ``compute_s`` for the straggler detector and the tuner.
        Pass ``False`` to register a communication hook of your own. That hook also
        stops a survivor of a peer's failure at its backward's next gradient bucket
        (:func:`dlrover_core.runtime.attempt_stop.check`), not at the backward's end,
        where DDP on gloo reports the failed all-reduce; a hook of your own may call
        ``check`` too."""
        from torch.nn.parallel import DistributedDataParallel

        from dlrover_core.tuning.metrics import measure_comm_wait as measure

        model = model.to(self.device)
        if self.context.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, **kwargs)
        return measure(ddp) if measure_comm_wait else ddp


class FSDPSession(TorchDistributedSession):
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

    def warm_up(self) -> None:
        """One training step of a small model (two ``Linear`` layers, each and the root
        ``fully_shard``-ed on a CPU mesh of the role's world size, AdamW,
        ``clip_grad_norm_``) in a :meth:`fake_group`: imports FSDP2, DeviceMesh and
        DTensor and runs their first-use paths; the CPU random state is restored after.
        Measured on this project's 2-CPU machine (2 gloo ranks, the nanogpt demo model):
        a fresh process's first ``wrap`` took 0.51-0.82 s, 0.02-0.04 s after this."""
        from torch.distributed.device_mesh import init_device_mesh

        with self.fake_group(), torch.random.fork_rng(devices=[]):
            warm_up_step(init_device_mesh("cpu", (max(1, int(self.context.world_size)),)))


def warm_up_step(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """:meth:`FSDPSession.warm_up`'s training step on ``mesh`` (a 1-D CPU DeviceMesh):
    ``Linear(16, 16)``, GELU, ``Linear(16, 16)``, each ``Linear`` and the root
    ``fully_shard``-ed; a batch of 4 random inputs; backward, ``clip_grad_norm_`` at 1.0,
    one AdamW step. Returns the model and the optimizer."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return model, opt
