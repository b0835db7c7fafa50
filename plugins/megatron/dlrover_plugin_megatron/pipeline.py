"""Pipeline-parallel training steps: megatron-core's schedules on GPUs, GPipe on gloo.

On a GPU (NCCL), :func:`megatron_forward_backward` runs megatron-core's own schedule,
``get_forward_backward_func()``: 1F1B (``forward_backward_pipelining_without_interleaving``)
at PP > 1, no pipelining at PP = 1. Those schedules allocate their buffers with
``torch.cuda.current_device()`` and count tokens on ``"cuda"``, so they need a GPU.
The interleaved schedule (virtual pipeline) is not used: the backend refuses
``virtual_pipeline`` > 1 at spec load.

On the CPU (gloo), :func:`gpipe_forward_backward` runs the same kind of step over the
pipeline-parallel group that ``parallel_state`` built, with
``torch.distributed.send``/``recv``, so a model split into stages trains there too.

Schedule (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks
using Pipeline Parallelism", section 2.2): every stage runs the forward pass of all
``m`` micro-batches, receiving each input activation from the previous stage and
sending its output to the next, then the backward passes in reverse order, receiving
the output gradient from the next stage and sending the input gradient back. The
last stage's loss of each micro-batch is divided by ``m``, so the accumulated
gradients are those of the mean loss over the whole batch, as one step at PP=1. A
stage holds the activations of all ``m`` micro-batches at once (GPipe's memory cost;
megatron-core's 1F1B schedule holds at most PP of them).

Point-to-point messages pair a rank with the rank of the same tensor-parallel index
in the next stage (``get_pipeline_model_parallel_next_rank``), so tensor and pipeline
parallelism combine; data parallelism is left to the caller (average the gradients
over the data-parallel group after the step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

#: ``stage_forward(micro_batch_index, input_activation)``: the stage's forward pass of
#: one micro-batch. ``input_activation`` is ``None`` on the first stage (the stage
#: reads its own inputs), else the tensor received from the previous stage. Returns
#: the output activation (any stage but the last) or the micro-batch's scalar loss
#: (the last stage).
StageForward = Callable[[int, "torch.Tensor | None"], torch.Tensor]


def _pp() -> tuple[Any, bool, bool, int, int]:
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev = ps.get_pipeline_model_parallel_prev_rank()
    nxt = ps.get_pipeline_model_parallel_next_rank()
    return ps.get_pipeline_model_parallel_group(), first, last, prev, nxt


def gpipe_forward_backward(stage_forward: StageForward, num_micro_batches: int,
                           activation_shape: Sequence[int],
                           dtype: torch.dtype = torch.float32,
                           forward_only: bool = False,
                           device: torch.device | None = None) -> float:
    """One pipelined forward (and backward) pass of ``num_micro_batches`` micro-batches
    through this rank's stage; gradients accumulate in the stage's parameters (zero
    them before, step the optimizer after).

    Args:
        stage_forward: see :data:`StageForward`.
        num_micro_batches: ``m`` >= 1.
        activation_shape: shape of the activation passed between stages, e.g.
            ``[sequence, micro_batch, hidden]`` (Megatron's layout); ``dtype`` its dtype.
        forward_only: no backward pass (evaluation).
        device: where activations and the loss live (the backend's ``device``; default
            the current CUDA device when there is one, else the CPU).

    Returns:
        The mean loss over the micro-batches (float, nats per token for a language
        model), on every stage (the last stage broadcasts it over the pipeline group).

    Raises:
        ValueError: ``num_micro_batches`` < 1, or the last stage's forward did not
            return a scalar.
        RuntimeError: a peer stage failed (torch.distributed's error).
    """
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: {num_micro_batches} is invalid; allowed: >= 1")
    group, first, last, prev, nxt = _pp()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    losses = torch.zeros(1, dtype=torch.float32, device=device)
    grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
    with grad_mode:
        for i in range(num_micro_batches):
            x = None
            if not first:
                x = torch.empty(tuple(activation_shape), dtype=dtype, device=device)
                dist.recv(x, src=prev, group=group)
                x.requires_grad_(not forward_only)
            out = stage_forward(i, x)
            if last:
                if out.dim() != 0:
                    raise ValueError(f"the last stage's forward returned shape "
                                     f"{tuple(out.shape)}; it must return the scalar loss")
                losses += out.detach().float()
            else:
                dist.send(out.detach().contiguous(), dst=nxt, group=group)
            inputs.append(x)
            outputs.append(out)
    if not forward_only:
        for x, out in zip(reversed(inputs), reversed(outputs)):
            if last:
                (out / num_micro_batches).backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=nxt, group=group)
                out.backward(grad)
            if not first:
                assert x is not None and x.grad is not None
                dist.send(x.grad.contiguous(), dst=prev, group=group)
    from megatron.core import parallel_state as ps

    last_rank = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(losses, src=last_rank, group=group)
    return float(losses) / num_micro_batches


#: ``forward_step(data_iterator, model)`` as megatron-core's schedules call it: runs the
#: stage's forward of the next micro-batch and returns ``(output, loss_func)``.
ForwardStep = Callable[[Any, Any], tuple]


def megatron_forward_backward(forward_step: ForwardStep, micro_batches: Sequence[Any],
                              model: Any, seq_length: int, micro_batch_size: int,
                              device: torch.device, forward_only: bool = False) -> float:
    """One step through megatron-core's schedule for this pipeline size
    (``megatron.core.pipeline_parallel.get_forward_backward_func()``: 1F1B at PP > 1);
    needs CUDA and a model whose config (``model.config``, reached through wrappers'
    ``.module``) sets ``pipeline_dtype`` when PP > 1.

    Args:
        forward_step: see :data:`ForwardStep`; its ``loss_func(output)`` returns
            ``(loss, {"loss": detached loss})`` for one micro-batch.
        micro_batches: the step's micro-batches, handed to ``forward_step`` through an
            iterator (every stage gets them; only the first stage reads inputs, the last
            labels).
        model: this rank's stage (one module; no model chunks).
        seq_length, micro_batch_size: the activation shape between stages
            ``[seq_length, micro_batch_size, hidden]``.
        device: the backend's device (the loss is broadcast there).
        forward_only: no backward pass (evaluation).

    Returns:
        The mean of the micro-batches' ``"loss"`` (float), on every stage (the last
        stage broadcasts it over the pipeline group).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    stores = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=forward_only)
    loss = torch.zeros(1, dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage():
        loss += torch.stack([d["loss"].float().to(device) for d in stores]).mean()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(loss, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return float(loss)
