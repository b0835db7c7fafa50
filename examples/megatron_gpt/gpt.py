"""The GPU path of the example: megatron-core's ``GPTModel`` (needs CUDA).

``build_gpt_model`` builds a ``GPTModel`` with the local (non-Transformer-Engine)
layer spec at the role's tensor-parallel size, and wraps it so that it has the same
``forward(idx, targets=None)`` as the CPU model. Pipeline parallelism needs
megatron-core's pipeline schedules (``get_forward_backward_func``), which this
example's training loop does not use: run it with ``pipeline_parallel: 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from examples.megatron_gpt.model import CharGPTShape


class GPTForChars(torch.nn.Module):
    """``GPTModel`` with the CPU model's interface: ``idx``, ``targets`` ``[b, s]``
    int64; returns the mean cross-entropy (nats/token) or the vocab-split logits.
    The dlrover ``megatron`` engine reaches the ``GPTModel`` through :attr:`module`."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.shape
        position_ids = torch.arange(s, device=idx.device).unsqueeze(0).expand(b, s)
        out = self.module(idx, position_ids, attention_mask=None, labels=targets)
        return out.float().mean() if targets is not None else out


def build_gpt_model(shape: CharGPTShape, backend: Any) -> GPTForChars:
    """A ``GPTModel`` for ``shape`` at the session's TP size, on the current GPU.

    Raises:
        RuntimeError: no CUDA device. ValueError: ``pipeline_parallel`` > 1.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("config.model=gpt needs a CUDA GPU (megatron-core's GPTModel); "
                           "use the default model on the CPU")
    if backend.settings.pipeline_parallel != 1:
        raise ValueError("this example's loop has no pipeline schedule: set "
                         "pipeline_parallel to 1")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        tensor_model_parallel_size=backend.settings.tensor_parallel,
        pipeline_model_parallel_size=1, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=shape.init_std)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=shape.vocab_size,
                     max_sequence_length=shape.block_size, parallel_output=True,
                     position_embedding_type="learned_absolute")
    return GPTForChars(model.cuda())
