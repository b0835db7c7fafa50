"""Gradient accumulation that keeps the global batch when the micro-batch changes.

The global batch of one optimizer step is ``micro_batch * grad_accum_steps *
world_size``. When a tuner doubles the micro-batch it halves ``grad_accum_steps``, so
every optimizer step still averages the gradient of the same number of samples; the
loss of each micro-batch is divided by ``grad_accum_steps`` before ``backward()``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


def grad_accum_steps_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step that give ``global_batch`` samples.

    Raises:
        ValueError: ``global_batch`` is not a multiple of ``micro_batch * world_size``.
    """
    per_step = micro_batch * world_size
    if micro_batch < 1 or world_size < 1 or global_batch % per_step:
        raise ValueError(
            f"global batch {global_batch} is not a multiple of micro_batch {micro_batch} x "
            f"world_size {world_size}; allowed: micro-batches that divide "
            f"{global_batch // max(world_size, 1)}")
    return global_batch // per_step


@contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce of a backward pass that is not the last of an
    accumulation cycle (``enabled=False``): DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync(False)``; a plain module needs nothing."""
    if enabled:
        yield
        return
    no_sync = getattr(model, "no_sync", None)
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)
    elif no_sync is not None:
        with no_sync():
            yield
    else:
        yield
