"""The trainer's step: one prequential (test-then-train) optimizer step, and the
slicing of a chunk into batches (:meth:`OnlineTrainerWorkload.train_step
<dlrover_plugin_odl.workloads.OnlineTrainerWorkload.train_step>`)."""

from __future__ import annotations

from typing import Any

import torch


def prequential_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    batch: dict | None, predict: Any, loss: Any,
                    shadow: dict | None = None) -> tuple[torch.Tensor, Any]:
    """One prequential step: predict ``batch`` with ``model.eval()`` and no gradient
    (dropout off, batch norm on its running statistics), then one optimizer step of
    ``loss(model, batch)`` with ``model.train()``.

    ``batch`` ``None`` (this rank has no records for the step): with ``shadow`` (any
    other batch) the same calls run on it and its loss is multiplied by 0, so this
    rank joins every DDP collective of the step (a buffer broadcast in a forward, the
    gradient all-reduce in backward) with a zero gradient, and takes the same
    optimizer step as the others (DDP averages over the ranks); without ``shadow``,
    a zero loss of the parameters, which joins no DDP collective (a model without
    DDP only).

    Args:
        predict: ``(model, batch) -> labels`` int64 ``[N]``. loss: ``(model, batch)
            -> scalar tensor``.
    Returns:
        ``(predictions [N] int64, or an empty tensor, loss tensor)``; the model is
        left in train mode.
    """
    predictions = torch.zeros(0, dtype=torch.int64)
    data = batch if batch is not None else shadow
    if data is not None:
        model.eval()
        with torch.no_grad():
            out = predict(model, data)
        if batch is not None:
            predictions = out
    model.train()
    if data is not None:
        value = loss(model, data)
        if batch is None:
            value = value * 0.0
    else:
        value = sum(p.sum() for p in model.parameters()) * 0.0
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    optimizer.step()
    return predictions, value


def batch_slice(batch: dict, start: int, stop: int, n: int) -> dict:
    """Records ``[start, stop)`` of a batch of ``n`` records: every tensor (or other
    sequence) whose dim 0 is ``n`` is sliced, other values are kept whole."""
    out = {}
    for k, v in batch.items():
        sized = isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n
        if not sized and hasattr(v, "__len__") and not isinstance(v, (str, bytes, dict)):
            sized = len(v) == n
        out[k] = v[start:stop] if sized else v
    return out
