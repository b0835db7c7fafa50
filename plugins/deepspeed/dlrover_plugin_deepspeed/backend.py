"""The ``deepspeed`` backend session: join the role's process group, wrap a model
and a torch optimizer into a ``DeepSpeedEngine``.

The process group is created from the role's rendezvous (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) with the job's ``failover.pg_timeout_s``;
NCCL on GPU, gloo on the CPU. DeepSpeed then adopts that group.

On the CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op (about 80 s) the
first time its communication backend starts. ZeRO training does not use it (it is
an inference all-reduce), so the session switches it off on the CPU unless the
role's env sets ``DLROVER_DS_SHM_COMM=1``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dlrover_core.runtime.backend import TorchDistributedSession


def _disable_cpu_shm_comm() -> None:
    """Mark DeepSpeed's CPU shared-memory comm op incompatible so that it is not built."""
    if os.environ.get("DLROVER_DS_SHM_COMM", "0") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedSession(TorchDistributedSession):
    """Process group + ``deepspeed.initialize`` for one rank."""

    def setup(self) -> None:
        if not torch.cuda.is_available():
            _disable_cpu_shm_comm()
        super().setup()
        import deepspeed

        deepspeed.init_distributed(dist_backend=self.dist_backend, dist_init_required=False,
                                   timeout=self.timeout)

    def wrap(self, model: torch.nn.Module, optimizer: Any = None, config: dict | None = None,
             **kwargs: Any) -> Any:
        """``deepspeed.initialize(model, optimizer, config)``; returns the ``DeepSpeedEngine``
        (its ``.optimizer`` is the ZeRO-wrapped optimizer).

        Args:
            model: the module, on any device (moved to :attr:`device`).
            optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters. Pass one:
                a named optimizer in ``config`` (``{"type": "AdamW"}``) compiles an op
                for about a minute on the CPU.
            config: the DeepSpeed config dict; ``train_micro_batch_size_per_gpu``
                defaults to 1 and ``gradient_accumulation_steps`` to 1.
            kwargs: more arguments of ``deepspeed.initialize`` (``lr_scheduler``...).
        Raises:
            ValueError: ``config`` is not a dict.
        """
        import deepspeed

        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise ValueError(f"wrap(config={config!r}): the DeepSpeed config must be a dict")
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, **config}
        model = model.to(self.device)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               dist_init_required=False, **kwargs)
        return engine
