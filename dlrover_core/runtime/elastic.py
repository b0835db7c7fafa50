"""The same training math at any world size: a fixed global batch kept by gradient
accumulation, the learning rate unchanged.

An optimizer step averages the gradient of ``global_batch`` samples, whatever the number
of data-parallel ranks: rank ``r`` of ``W`` runs ``grad_accum_steps = global_batch /
(micro_batch * W)`` micro-batches (:func:`dlrover_core.tuning.accumulation.grad_accum_steps_for`),
divides each micro-batch's mean loss by ``grad_accum_steps`` before ``backward()``, and
the data-parallel all-reduce averages over the ``W`` ranks (DDP/FSDP divide by ``W``). The
gradient is then the mean over all ``global_batch`` samples, as on one rank with the whole
batch (the usual accumulation identity: the mean of equal-sized means is the mean).
Only the order of the floating-point sums differs, so losses agree to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dlrover_core.tuning.accumulation import grad_accum_steps_for, gradient_sync


@dataclass(frozen=True)
class ElasticBatch:
    """How one optimizer step's ``global_batch`` samples are split at ``world_size``.

    Args:
        global_batch: samples per optimizer step (all ranks together).
        micro_batch: samples per forward/backward on one rank.
        world_size: data-parallel ranks.

    Raises:
        ValueError: ``global_batch`` is not a multiple of ``micro_batch * world_size``.
    """

    global_batch: int
    micro_batch: int
    world_size: int

    def __post_init__(self) -> None:
        grad_accum_steps_for(self.global_batch, self.micro_batch, self.world_size)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return grad_accum_steps_for(self.global_batch, self.micro_batch, self.world_size)

    def micro_ranges(self, step: int, rank: int, start: int = 0) -> list[range]:
        """Sample positions of ``rank``'s micro-batches at optimizer ``step`` when the data
        is read in a fixed order from position ``start``: step ``s`` takes positions
        ``[start + s*global_batch, start + (s+1)*global_batch)``, rank ``r`` the ``r``-th
        contiguous ``global_batch / world_size`` of them, cut into micro-batches. The
        same step covers the same positions at every world size.

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        per_rank = self.global_batch // self.world_size
        base = start + step * self.global_batch + rank * per_rank
        return [range(base + m * self.micro_batch, base + (m + 1) * self.micro_batch)
                for m in range(self.grad_accum_steps)]


def largest_world_size(global_batch: int, micro_batch: int, max_ranks: int,
                       min_ranks: int = 1) -> int:
    """The largest world size in ``[min_ranks, max_ranks]`` at which ``global_batch``
    splits into whole micro-batches (``global_batch % (micro_batch * W) == 0``).

    Raises:
        ValueError: no world size in the range divides the global batch.
    """
    for w in range(max_ranks, min_ranks - 1, -1):
        if w >= 1 and global_batch % (micro_batch * w) == 0:
            return w
    raise ValueError(f"no world size in [{min_ranks}, {max_ranks}] splits global batch "
                     f"{global_batch} into micro-batches of {micro_batch}")


def accumulation_step(model: Any, optimizer: Any, micro_batches: Sequence[Any],
                      loss_fn: Callable[[Any, Any], Any]) -> float:
    """One optimizer step over this rank's ``micro_batches`` (gradient accumulation).

    ``loss_fn(model, batch)`` returns the batch's mean loss (a scalar tensor). Each loss is
    divided by ``len(micro_batches)`` before ``backward()``; the gradient all-reduce of a
    DDP/FSDP ``model`` runs only on the last backward (:func:`gradient_sync`). Returns the
    mean loss over the global batch (the local mean, averaged over the ranks with an
    ``all_reduce`` when a process group is initialized), a Python float. The loss sum is
    kept in float64 on the losses' device, so the ``all_reduce`` gets a tensor on the
    device the model computes on (NCCL reduces only CUDA tensors).

    Raises:
        ValueError: ``micro_batches`` is empty.
    """
    import torch.distributed as dist

    n = len(micro_batches)
    if n == 0:
        raise ValueError("accumulation_step: micro_batches is empty; an optimizer step "
                         "needs at least one micro-batch")
    optimizer.zero_grad(set_to_none=True)
    total = None
    for i, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=i == n - 1):
            loss = loss_fn(model, batch)
            (loss / n).backward()
        part = loss.detach().double()
        total = part if total is None else total + part
    optimizer.step()
    mean = total / n
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return float(mean)
