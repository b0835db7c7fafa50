"""The GPU path of the example: megatron-core's ``GPTModel`` (needs CUDA).

``build_gpt_model`` builds a ``GPTModel`` with the local (non-Transformer-Engine)
layer spec at the role's tensor-parallel size, and wraps it so that it has the same
``forward(idx, targets=None)`` as the CPU model. With ``pipeline_parallel`` > 1 each
rank builds its stage (``pre_process`` on the first, ``post_process`` on the last)
and the loop runs megatron-core's 1F1B schedule with :func:`gpt_forward_step`
(:func:`dlrover_plugin_megatron.pipeline.megatron_forward_backward`).
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduce: bool = True) -> torch.Tensor:
        """The last stage: the mean loss (``reduce``) or per-token losses ``[b, s]``
        with ``targets``, else logits; any other stage: its output activation
        ``[s, b, hidden]`` (the input comes from ``set_input_tensor``)."""
        b, s = idx.shape
        position_ids = torch.arange(s, device=idx.device).unsqueeze(0).expand(b, s)
        out = self.module(idx, position_ids, attention_mask=None, labels=targets)
        last = getattr(self.module, "post_process", True)
        return out.float().mean() if targets is not None and reduce and last else out


def gpt_forward_step(data_iterator, model):
    """megatron-core's ``forward_step_func`` for :class:`GPTForChars` (possibly in
    DDP): the next ``(idx, targets)`` micro-batch through this stage; the loss function
    is the mean cross-entropy (nats/token) of the micro-batch."""
    idx, targets = next(data_iterator)
    out = model(idx, targets, reduce=False)

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def build_gpt_model(shape: CharGPTShape, backend: Any) -> GPTForChars:
    """This rank's stage of a ``GPTModel`` for ``shape`` at the session's TP and PP
    sizes, on the rank's GPU (``backend.device``).

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("config.model=gpt needs a CUDA GPU (megatron-core's GPTModel); "
                           "use the default model on the CPU")
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        tensor_model_parallel_size=backend.settings.tensor_parallel,
        pipeline_model_parallel_size=backend.settings.pipeline_parallel,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=shape.init_std)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=shape.vocab_size,
                     max_sequence_length=shape.block_size, parallel_output=True,
                     position_embedding_type="learned_absolute",
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     # tied embeddings across the first and last stage would need
                     # megatron's embedding-group gradient reduction
                     share_embeddings_and_output_weights=False)
    return GPTForChars(model.to(backend.device))
