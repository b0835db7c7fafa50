"""The ``megatron`` backend session: the role's torch.distributed group, then
megatron-core's model-parallel groups (``parallel_state``) over it.

Sizes come from the role's config (:mod:`dlrover_plugin_megatron.settings`): TP, PP,
CP and the virtual pipeline; the data-parallel size is the rest of the role's world
size. ``parallel_state`` orders ranks ``tp-cp-ep-dp-pp`` (its default): with 4 ranks
and TP=2, ranks 0-1 and 2-3 are the tensor-parallel groups, 0-2 and 1-3 the
data-parallel ones.
"""

from __future__ import annotations

import math
from typing import Any

from dlrover_core.runtime.backend import TorchDistributedSession
from dlrover_plugin_megatron.settings import MegatronSettings


class MegatronSession(TorchDistributedSession):
    """Process group + ``parallel_state.initialize_model_parallel`` for one rank.

    Attributes (after :meth:`setup`):
        settings: the role's :class:`MegatronSettings`.
        seed: this rank's seed (:func:`dlrover_plugin_megatron.seeding.rank_seed`).
    """

    settings: MegatronSettings
    seed: int

    def setup(self) -> None:
        """Join the role's group, build the model-parallel groups, seed this rank.

        Raises:
            SpecError: bad sizes in the role's config (also refused at spec load).
        """
        from megatron.core import parallel_state as ps

        from dlrover_plugin_megatron.seeding import seed_rank

        self.settings = MegatronSettings.from_config(self.context.config,
                                                     self.context.world_size)
        if ps.model_parallel_is_initialized():  # a re-setup in a surviving process
            ps.destroy_model_parallel()
        super().setup()
        s = self.settings
        ps.initialize_model_parallel(
            tensor_model_parallel_size=s.tensor_parallel,
            pipeline_model_parallel_size=s.pipeline_parallel,
            virtual_pipeline_model_parallel_size=(s.virtual_pipeline
                                                  if (s.virtual_pipeline or 1) > 1 else None),
            context_parallel_size=s.context_parallel,
            distributed_timeout_minutes=max(1, math.ceil(self.timeout.total_seconds() / 60)),
            # the extra gloo groups serve the distributed optimizer's checkpoints on GPU;
            # on the CPU every group is gloo already
            create_gloo_process_groups=self.device.type == "cuda",
        )
        self.seed = seed_rank(s.seed, bool(self.context.config.get("data_parallel_random_init",
                                                                   False)))

    def teardown(self) -> None:
        """Forget the model-parallel groups, then leave the process group (never raises),
        so that :meth:`setup` can run again in this process after a peer failed."""
        try:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - a broken group cannot always be destroyed
            pass
        super().teardown()

    # ------------------------------------------------------------------ ranks
    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_rank()

    @property
    def cp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_context_parallel_rank()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.settings.data_parallel

    def model_parallel_config(self, **overrides: Any) -> Any:
        """A ``megatron.core.ModelParallelConfig`` with this role's sizes; on the CPU
        with ``use_cpu_initialization=True`` (weights are initialised whole from the
        seed, then split, so every TP size starts from the same global weights).
        ``overrides`` are more fields of the config."""
        import torch
        from megatron.core.model_parallel_config import ModelParallelConfig

        s = self.settings
        kw: dict[str, Any] = dict(
            tensor_model_parallel_size=s.tensor_parallel,
            pipeline_model_parallel_size=s.pipeline_parallel,
            context_parallel_size=s.context_parallel,
            virtual_pipeline_model_parallel_size=(s.virtual_pipeline
                                                  if (s.virtual_pipeline or 1) > 1 else None),
            use_cpu_initialization=self.device.type != "cuda",
            params_dtype=torch.float32,
        )
        kw.update(overrides)
        return ModelParallelConfig(**kw)

    def wrap(self, model: Any, **kwargs: Any) -> Any:
        """Move ``model`` to :attr:`device`; with a data-parallel size > 1 wrap it in
        torch ``DistributedDataParallel`` over the data-parallel group (with context
        parallelism), which averages gradients across model replicas; ``kwargs`` go
        to DDP. Tensor-parallel gradients are reduced inside megatron-core's layers."""
        from megatron.core import parallel_state as ps
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if self.dp_size * self.settings.context_parallel == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=ids,
            process_group=ps.get_data_parallel_group(with_context_parallel=True), **kwargs)
