"""Helpers of :mod:`dlrover_core.runtime.sharding`: the span arithmetic of leased
positions, the all-gather the ranks agree through, and :class:`ShardBatchSampler` (a
``DataLoader`` batch sampler over a ``ShardSampler``)."""

from __future__ import annotations

from typing import Any, Iterator


def _count(spans: list[tuple[int, int, int]]) -> int:
    return sum(hi - lo for _, lo, hi in spans)


def _spans(items: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(shard, position)`` pairs -> ``(shard, lo, hi)`` spans of consecutive positions."""
    out: list[list[int]] = []
    for sid, p in items:
        if out and out[-1][0] == sid and out[-1][2] == p:
            out[-1][2] = p + 1
        else:
            out.append([sid, p, p + 1])
    return [tuple(x) for x in out]  # type: ignore[misc]


def _all_gather(obj: Any) -> list:
    """Every rank's ``obj`` over the default process group (``[obj]`` without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


class ShardBatchSampler:
    """A ``torch.utils.data.Sampler`` of index batches over a :class:`ShardSampler`, for
    ``DataLoader(dataset, batch_sampler=ShardBatchSampler(sampler))``: yields the batches
    the sampler leases until no shard is left. Report each optimizer step with
    ``sampler.step_done(step)`` (with ``num_workers > 0`` the loader reads ahead: pass
    ``batches=``, the number of batches that step trained). ``len()`` is not defined
    (the number of batches depends on the other ranks)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        while (idx := self.sampler.next_indices()) is not None:
            yield idx
