"""Character-level GPT pre-training under the ``megatron`` backend.

On the CPU (the default here): :class:`~examples.megatron_gpt.model.TensorParallelCharGPT`,
built from megatron-core's tensor-parallel layers, at ``tensor_parallel`` ranks over
gloo; with ``pipeline_parallel`` > 1 each rank builds its stage and a step runs
``micro_batches`` micro-batches through the stages with
:func:`dlrover_plugin_megatron.pipeline.gpipe_forward_backward`. With CUDA and
``config.model: gpt``: megatron-core's ``GPTModel`` (:mod:`examples.megatron_gpt.gpt`),
with TP, and with PP through megatron-core's 1F1B schedule
(:func:`dlrover_plugin_megatron.pipeline.megatron_forward_backward`).

Data: the Python reference manual (``examples.nanogpt.data.CharDataset``, 103
symbols, the last 10% held out). Every rank of a tensor-parallel group reads the same
batch (batches are a function of ``(seed, data-parallel rank, step)``); gradients are
averaged over the data-parallel ranks by the backend's DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload
from examples.char_training import (
    adamw,
    maybe_fault,
    resume,
    train,
    warmup_cosine_lr,
)
from examples.megatron_gpt.model import CharGPTShape, TensorParallelCharGPT
from examples.nanogpt.data import CharDataset


class MegatronGPTWorkload(BaseWorkload):
    @classmethod
    def warm_up(cls) -> None:
        """In a standby process: import megatron-core and load the data."""
        import megatron.core.tensor_parallel  # noqa: F401

        CharDataset()

    def setup(self) -> None:
        c = self.config
        self.data = CharDataset()
        self.shape = CharGPTShape(vocab_size=int(c.get("padded_vocab_size", 128)),
                                  block_size=int(c.block_size), num_layers=int(c.num_layers),
                                  num_attention_heads=int(c.num_attention_heads),
                                  hidden_size=int(c.hidden_size))
        if self.data.vocab_size > self.shape.vocab_size:
            raise ValueError(f"config.padded_vocab_size {self.shape.vocab_size} is smaller "
                             f"than the data's {self.data.vocab_size} symbols")
        # the backend seeded this rank (equal within a TP group); the model's weights
        # are drawn whole from that seed and then split, so any TP size starts the same
        if c.get("model", "tp_char_gpt") == "gpt":
            from examples.megatron_gpt.gpt import build_gpt_model

            model = build_gpt_model(self.shape, self.backend)
        else:
            model = TensorParallelCharGPT(self.shape)
        self.pp = self.backend.settings.pipeline_parallel
        self.gpu_schedule = self.backend.device.type == "cuda"
        if self.pp > 1 and self.gpu_schedule and c.get("model", "tp_char_gpt") != "gpt":
            raise ValueError("config.model: 'tp_char_gpt' with pipeline_parallel > 1 on a GPU "
                             "is not supported; allowed: model 'gpt' (megatron-core's "
                             "schedule), or the CPU")
        self.micro_batches = int(c.get("micro_batches", 2 * self.pp if self.pp > 1 else 1))
        if self.micro_batches < 1 or int(c.batch_size) % self.micro_batches:
            raise ValueError(f"config.micro_batches: {self.micro_batches} is invalid; allowed: "
                             f"a divisor of config.batch_size {int(c.batch_size)}")
        self.num_params = _num_params(model, self.backend.device)
        # with pipeline stages, gradients are averaged over data parallel after the
        # whole pipelined step (DDP would reduce at every micro-batch's backward)
        self.model = self.backend.wrap(model) if self.pp == 1 else model.to(self.backend.device)
        self.opt = adamw(self.model.parameters(), c)
        resume(self)

    def lr_at(self, step: int) -> float:
        """Linear warm-up for ``warmup_steps``, then cosine decay to ``lr / 10``."""
        return warmup_cosine_lr(step, float(self.config.lr), self.config)

    def _batch(self, split: str, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(split, int(self.config.batch_size), self.shape.block_size, seed,
                               self.backend.dp_rank, step)
        return x.to(self.backend.device), y.to(self.backend.device)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/char) over ``eval_batches`` batches per
        data-parallel rank, averaged over them."""
        n = int(self.config.get("eval_batches", 8))
        self.model.eval()
        # on the backend's device: NCCL reduces only CUDA tensors
        total = torch.zeros(1, device=self.backend.device)
        for i in range(n):
            x, y = self._batch("val", i, 0)
            if self.pp > 1:
                total += self._pipelined(x, y, 1, forward_only=True)
            else:
                total += self.model(x, y).detach().float()
        self.model.train()
        total /= n
        if self.backend.dp_size > 1:
            from megatron.core import parallel_state as ps

            dist.all_reduce(total, group=ps.get_data_parallel_group())
            total /= self.backend.dp_size
        return float(total)

    def _pipelined(self, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                   forward_only: bool = False) -> float:
        """One pipelined pass of the batch ``x``, ``y`` ``[b, s]`` in ``micro_batches``
        micro-batches through the stages: megatron-core's 1F1B schedule on a GPU, GPipe
        on gloo; returns the mean loss."""
        from dlrover_plugin_megatron.pipeline import (gpipe_forward_backward,
                                                      megatron_forward_backward)

        xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)
        if self.gpu_schedule:
            from examples.megatron_gpt.gpt import gpt_forward_step

            return megatron_forward_backward(
                gpt_forward_step, list(zip(xs, ys)), self.model, self.shape.block_size,
                xs[0].shape[0], self.backend.device, forward_only=forward_only)
        shape = (self.shape.block_size, xs[0].shape[0], self.shape.hidden_size)
        return gpipe_forward_backward(lambda i, h: self.model(xs[i], ys[i], hidden=h),
                                      micro_batches, shape, forward_only=forward_only,
                                      device=self.backend.device)

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of one batch (gradients averaged over data parallel);
        returns the loss."""
        if self.pp == 1:
            loss = self.model(x, y)
            loss.backward()
            return loss.item()
        loss = self._pipelined(x, y, self.micro_batches)
        if self.backend.dp_size > 1:
            from megatron.core import parallel_state as ps

            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                    p.grad /= self.backend.dp_size
        return loss

    _maybe_fault = maybe_fault  # config.fault: the tests' injected faults

    def run(self) -> dict:
        seed = int(self.config.get("seed", 1337))

        def train_step(step: int) -> float:
            x, y = self._batch("train", step, seed)
            self.opt.zero_grad(set_to_none=True)
            loss = self._train_step(x, y)
            _clip_grad_norm(self.model, 1.0, self.backend.device)
            self.opt.step()
            return loss

        return train(self, train_step, int(self.config.batch_size) * self.backend.dp_size)


def _num_params(model: torch.nn.Module, device: torch.device) -> int:
    """Parameters of the whole model: TP-split ones counted at their global size, the
    stages' summed over the pipeline group (reduced on ``device``, the backend's)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    n = torch.tensor([sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
                          for p in model.parameters())], device=device)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(n, group=ps.get_pipeline_model_parallel_group())
    return int(n)


def _clip_grad_norm(model: torch.nn.Module, max_norm: float, device: torch.device) -> float:
    """Clip by the global gradient norm over the whole model: squares of TP-split
    gradients are summed over the tensor-parallel group, replicated ones counted once,
    and the stages' sums over the pipeline group (Megatron-LM's ``clip_grad_norm_fp32``),
    all on ``device`` (the backend's: NCCL reduces only CUDA tensors).
    Returns the norm before clipping."""
    from megatron.core import parallel_state as ps

    split = torch.zeros(1, device=device)
    whole = torch.zeros(1, device=device)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum().to(device)
        if getattr(p, "tensor_model_parallel", False):
            split += sq
        else:
            whole += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(split, group=ps.get_tensor_model_parallel_group())
    total = split + whole
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
