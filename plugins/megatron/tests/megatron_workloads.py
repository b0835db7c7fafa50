"""Workloads for the megatron plugin's tests (imported by Ray workers as
``plugins.megatron.tests.megatron_workloads``), driven through the host's ``call``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload
from dlrover_core.runtime.elastic import accumulation_step
from dlrover_core.testing import flatten_state
from examples.megatron_gpt.model import CharGPTShape, LayerStack, TensorParallelCharGPT

SHAPE = CharGPTShape(vocab_size=32, block_size=16, num_layers=2, num_attention_heads=4,
                     hidden_size=32)


def _name(n: str) -> str:
    return n.removeprefix("module.")  # DDP's prefix (data parallel > 1)


class TPTrainer(BaseWorkload):
    """A small :class:`TensorParallelCharGPT` + AdamW under the ``megatron`` backend.
    ``config.ckpt`` stands in for the job's ``checkpoint`` section (no job spec here);
    ``config.num_layers`` (default ``SHAPE.num_layers``) the number of blocks over all
    pipeline stages."""

    def setup(self) -> None:
        ck = self.config.get("ckpt")
        if ck is not None:
            from omegaconf import OmegaConf

            self.context.checkpoint = OmegaConf.to_container(ck)
        shape = dataclasses.replace(SHAPE, num_layers=int(self.config.get("num_layers",
                                                                          SHAPE.num_layers)))
        self.model = self.backend.wrap(self.build_model(shape))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0}

    def build_model(self, shape: CharGPTShape) -> torch.nn.Module:
        return TensorParallelCharGPT(shape)

    def step(self) -> None:
        """One AdamW step on made-up gradients (no forward: a pipeline stage alone has
        no loss); it fills the optimizer's state."""
        for p in self.model.parameters():
            p.grad = torch.sin(p.detach() * 7.0)
        self.opt.step()
        self.extra["step"] += 1

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + self.backend.dp_rank)
        x = torch.randint(0, 20, (4, SHAPE.block_size + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    def train(self, steps: int) -> list[float]:
        """``steps`` AdamW steps (:func:`accumulation_step`, one micro-batch each); their
        losses, each the mean over all ranks."""
        losses = []
        for _ in range(steps):
            batch = self.batch(self.extra["step"])
            losses.append(accumulation_step(self.model, self.opt, [batch],
                                            lambda model, b: model(*b)))
            self.extra["step"] += 1
        return losses

    # ------------------------------------------------------------ full tensors
    def _gather(self, t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        if not getattr(p, "tensor_model_parallel", False) \
                or ps.get_tensor_model_parallel_world_size() == 1:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=p.partition_dim)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter at its global shape (TP parts gathered)."""
        return {_name(n): self._gather(p.data, p) for n, p in self.model.named_parameters()}

    def set_full_params(self, full: dict[str, torch.Tensor]) -> None:
        """Load global tensors: each rank keeps its own TP part."""
        from megatron.core import parallel_state as ps

        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                t = full[_name(n)]
                if getattr(p, "tensor_model_parallel", False):
                    t = t.chunk(tp, dim=p.partition_dim)[r]
                p.copy_(t)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """Loss, full logits ``[s, b, vocab]`` and full gradients for one batch."""
        from megatron.core import parallel_state as ps

        self.opt.zero_grad()
        logits = self.model(x)
        loss = self.model(x, y)
        loss.backward()
        tp = ps.get_tensor_model_parallel_world_size()
        full_logits = logits.detach()
        if tp > 1:
            parts = [torch.empty_like(full_logits) for _ in range(tp)]
            dist.all_gather(parts, full_logits.contiguous(),
                            group=ps.get_tensor_model_parallel_group())
            full_logits = torch.cat(parts, dim=-1)
        grads = {_name(n): self._gather(p.grad, p) for n, p in self.model.named_parameters()}
        return {"loss": float(loss), "logits": full_logits, "grads": grads}

    def pipelined_forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                                   micro_batches: int) -> dict:
        """Loss and the full gradients of this stage's parameters for one batch run
        through the pipeline stages in ``micro_batches`` micro-batches (GPipe)."""
        from dlrover_plugin_megatron.pipeline import gpipe_forward_backward

        self.opt.zero_grad()
        xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
        loss = gpipe_forward_backward(lambda i, h: self.model(xs[i], ys[i], hidden=h),
                                      micro_batches,
                                      (SHAPE.block_size, xs[0].shape[0], SHAPE.hidden_size))
        grads = {_name(n): self._gather(p.grad, p) for n, p in self.model.named_parameters()}
        return {"loss": loss, "grads": grads}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_backward(x, torch.zeros_like(x))["logits"]

    def hidden_split_error(self) -> str:
        """What the engine says about a TP layer inside a plain ``torch.nn.ModuleList``."""
        from megatron.core import tensor_parallel
        from megatron.core.transformer.module import MegatronModule

        from dlrover_plugin_megatron.engine import MegatronEngine

        config = self.model.config

        class Hidden(MegatronModule):
            def __init__(self) -> None:
                super().__init__(config)
                self.blocks = torch.nn.ModuleList([tensor_parallel.ColumnParallelLinear(
                    8, 8, config=config, init_method=torch.nn.init.zeros_, bias=False,
                    gather_output=False)])

        try:
            MegatronEngine().state_dict({"model": Hidden()})
        except NotImplementedError as exc:
            return str(exc)
        return ""

    # ------------------------------------------------------------ checkpoints
    def objects(self) -> dict:
        return {"model": self.model, "optimizer": self.opt, "extra": self.extra}

    def save(self, step: int) -> float:
        return self.checkpointer.save(step, **self.objects())

    def wait(self) -> None:
        self.checkpointer.wait()

    def load(self, step: int | None = None) -> dict:
        loaded = self.checkpointer.load(step, **self.objects())
        return {"step": loaded, "source": getattr(self.checkpointer.saver, "last_load_source",
                                                  "disk")}

    def flat_state(self) -> dict:
        return flatten_state(self.checkpointer.engine.state_dict(self.objects()))

    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW moments of every parameter at global shape, keyed by parameter name."""
        out = {}
        for n, p in self.model.named_parameters():
            st = self.opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[f"{_name(n)}.{k}"] = self._gather(st[k], p)
        return out


class GPTTrainer(TPTrainer):
    """megatron-core's ``GPTModel`` (GPU only) in place of the CPU model."""

    def setup(self) -> None:
        from examples.megatron_gpt.gpt import build_gpt_model

        ck = self.config.get("ckpt")
        if ck is not None:
            from omegaconf import OmegaConf

            self.context.checkpoint = OmegaConf.to_container(ck)
        self.model = self.backend.wrap(build_gpt_model(SHAPE, self.backend))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().batch(step)
        return x.cuda(), y.cuda()


class StackedLayers(LayerStack):
    """The blocks saved the way megatron-core's ``TransformerBlock`` saves its layers:
    one key per parameter for all layers (``layers.attn.qkv.weight``), the global layer
    index a prepended axis of the sharded tensor (``prepend_axis_num=1``, offset
    ``(0, layer, num_layers)``)."""

    def __init__(self, config: Any, shape: CharGPTShape, first: int, count: int) -> None:
        super().__init__(config, shape, first, count)
        self.first, self.total = first, shape.num_layers

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        out: dict = {}
        for i, name in enumerate(self.names):
            local = f"{prefix}{name}."
            part = getattr(self, name).sharded_state_dict(
                prefix=local, sharded_offsets=((0, self.first + i, self.total),),
                metadata=metadata)
            replace_prefix_for_sharding(part, local, prefix)
            out.update(part)
        return out


class StackedTrainer(TPTrainer):
    """:class:`TPTrainer` whose blocks are saved as stacked layers (:class:`StackedLayers`)."""

    def build_model(self, shape: CharGPTShape) -> torch.nn.Module:
        from megatron.core import parallel_state as ps

        model = TensorParallelCharGPT(shape)
        per = shape.num_layers // ps.get_pipeline_model_parallel_world_size()
        model.layers = StackedLayers(model.config, shape,
                                     ps.get_pipeline_model_parallel_rank() * per, per)
        return model
