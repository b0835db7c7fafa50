"""A character GPT built from megatron-core's tensor-parallel layers; runs on the CPU.

megatron-core's ``GPTModel`` needs CUDA (see ``gpt.py`` for the GPU path); this model
uses the same tensor-parallel building blocks, which work over gloo:

- token embedding: ``VocabParallelEmbedding`` (rows of the vocabulary split over TP);
- attention: ``ColumnParallelLinear`` for Q, K, V (each rank holds whole heads),
  causal ``scaled_dot_product_attention`` on the local heads, ``RowParallelLinear``
  for the output projection (its all-reduce sums the ranks' partial outputs);
- MLP: ``ColumnParallelLinear`` (h -> 4h), GELU, ``RowParallelLinear`` (4h -> h);
- output layer: ``ColumnParallelLinear`` (h -> vocabulary, not gathered) and
  ``vocab_parallel_cross_entropy`` on the split logits (Megatron-LM's layout:
  activations ``[sequence, batch, hidden]``).

Layer norms and the position embedding are replicated on every TP rank. The
tensor-parallel arithmetic follows Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3.

Pipeline parallelism: with ``pipeline_parallel`` = PP, the model built on a rank is
that rank's stage: ``num_layers / PP`` consecutive blocks, the embeddings on the first
stage, the final layer norm, output layer and loss on the last one. Blocks are named by
their global index (``layers.<i>``), so checkpoints move between pipeline layouts.
Stages exchange activations through ``dlrover_plugin_megatron.pipeline`` (a GPipe
schedule over gloo; megatron-core's schedules need CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal, scaled_init_method_normal


@dataclass
class CharGPTShape:
    """Model size: ``vocab_size`` is the padded vocabulary (a multiple of TP, the
    same at every TP size so checkpoints move between them); ``block_size`` the
    context length in characters."""

    vocab_size: int = 128
    block_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    hidden_size: int = 128
    init_std: float = 0.02


def transformer_config(shape: CharGPTShape, tensor_parallel_size: int) -> TransformerConfig:
    """The megatron-core config of the layers (fp32, weights initialised on the CPU)."""
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        tensor_model_parallel_size=tensor_parallel_size, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=shape.init_std)


class ParallelSelfAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, shape: CharGPTShape) -> None:
        super().__init__(config)
        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = shape.num_attention_heads // tp
        self.head_dim = shape.hidden_size // shape.num_attention_heads
        h = shape.hidden_size
        # output columns ordered [head, (q, k, v), head_dim]: a contiguous split by
        # TP gives each rank whole heads, the same global weight at every TP size
        self.qkv = tensor_parallel.ColumnParallelLinear(
            h, 3 * h, config=config, init_method=init_method_normal(shape.init_std),
            bias=True, gather_output=False)
        self.proj = tensor_parallel.RowParallelLinear(
            h, h, config=config,
            init_method=scaled_init_method_normal(shape.init_std, shape.num_layers),
            bias=True, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[s, b, h]`` float32 -> ``[s, b, h]``."""
        s, b, _ = x.shape
        qkv, _ = self.qkv(x)                                   # [s, b, 3h/tp]
        qkv = qkv.view(s, b, self.heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                      # [b, heads/tp, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        out, _ = self.proj(y)
        return out


class ParallelMLP(MegatronModule):
    def __init__(self, config: TransformerConfig, shape: CharGPTShape) -> None:
        super().__init__(config)
        h = shape.hidden_size
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            h, 4 * h, config=config, init_method=init_method_normal(shape.init_std), bias=True,
            gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            4 * h, h, config=config,
            init_method=scaled_init_method_normal(shape.init_std, shape.num_layers), bias=True,
            input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.fc1(x)
        y, _ = self.fc2(F.gelu(y))
        return y


class Block(MegatronModule):
    def __init__(self, config: TransformerConfig, shape: CharGPTShape) -> None:
        super().__init__(config)
        self.ln1 = torch.nn.LayerNorm(shape.hidden_size)
        self.attn = ParallelSelfAttention(config, shape)
        self.ln2 = torch.nn.LayerNorm(shape.hidden_size)
        self.mlp = ParallelMLP(config, shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LayerStack(MegatronModule):
    """The blocks, named by their global index. A ``MegatronModule`` (not a
    ``torch.nn.ModuleDict``): megatron-core's ``sharded_state_dict`` recurses only into
    megatron modules and treats any other module's tensors as replicated."""

    def __init__(self, config: TransformerConfig, shape: CharGPTShape, first: int,
                 count: int) -> None:
        super().__init__(config)
        self.names = [str(i) for i in range(first, first + count)]
        for name in self.names:
            self.add_module(name, Block(config, shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.names:
            x = getattr(self, name)(x)
        return x


class TensorParallelCharGPT(MegatronModule):
    """The model, or this rank's pipeline stage of it; build it after
    ``parallel_state`` is initialised (the ``megatron`` backend's setup does that),
    with the same seed on every TP rank.

    ``forward(idx, targets=None, hidden=None)``: ``idx`` ``[b, s]`` int64 token ids
    (read by the first stage), ``hidden`` ``[s, b, h]`` float32 the previous stage's
    output (any other stage). The last stage returns the vocab-split logits
    ``[s, b, vocab/tp]`` float32, or with ``targets`` ``[b, s]`` the mean cross-entropy
    (nats/token, a float32 scalar equal on every TP rank); any other stage returns
    its output ``[s, b, h]``.

    Raises:
        ValueError: ``vocab_size`` not a multiple of TP, or ``num_layers`` not a
            multiple of PP.
    """

    def __init__(self, shape: CharGPTShape) -> None:
        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        if shape.vocab_size % tp:
            raise ValueError(f"vocab_size {shape.vocab_size} must be a multiple of "
                             f"tensor_parallel {tp}")
        if shape.num_layers % pp:
            raise ValueError(f"num_layers {shape.num_layers} must be a multiple of "
                             f"pipeline_parallel {pp}")
        config = transformer_config(shape, tp)
        super().__init__(config)
        self.shape = shape
        self.pre_process = ps.is_pipeline_first_stage()
        self.post_process = ps.is_pipeline_last_stage()
        h, per = shape.hidden_size, shape.num_layers // pp
        if self.pre_process:
            self.embedding = tensor_parallel.VocabParallelEmbedding(
                shape.vocab_size, h, init_method=init_method_normal(shape.init_std),
                config=config)
            self.position = torch.nn.Embedding(shape.block_size, h)
            torch.nn.init.normal_(self.position.weight, std=shape.init_std)
        self.layers = LayerStack(config, shape, ps.get_pipeline_model_parallel_rank() * per, per)
        if self.post_process:
            self.ln_f = torch.nn.LayerNorm(h)
            self.output = tensor_parallel.ColumnParallelLinear(
                h, shape.vocab_size, config=config,
                init_method=init_method_normal(shape.init_std), bias=False,
                gather_output=False)

    def num_params(self) -> int:
        """Parameters of this stage (all its TP ranks together)."""
        tp = ps.get_tensor_model_parallel_world_size()
        n = 0
        for p in self.parameters():
            n += p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        return n

    def forward(self, idx: torch.Tensor | None, targets: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_process:
            assert idx is not None
            s = idx.shape[1]
            x = self.embedding(idx.t().contiguous())            # [s, b, h]
            x = x + self.position.weight[:s].unsqueeze(1)
        else:
            if hidden is None:
                raise ValueError("a pipeline stage after the first needs hidden, the "
                                 "previous stage's output [s, b, h]")
            x = hidden
        x = self.layers(x)
        if not self.post_process:
            return x
        logits, _ = self.output(self.ln_f(x))                  # [s, b, vocab/tp]
        if targets is None:
            return logits
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(),
                                                           targets.t().contiguous())
        return loss.mean()
