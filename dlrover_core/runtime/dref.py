"""``DRef``: results that stay on the workers that produced them.

A non-blocking role-group call returns a ``DRef``: one Ray ``ObjectRef`` per rank.
Passing a ``DRef`` to another role's call hands the consumer references, not data.

Where the bytes live depends on their size, as Ray decides it:

- a result above Ray's inline-object limit (``max_direct_call_object_size``,
  100 KiB by default; ``RAY_max_direct_call_object_size`` changes it) stays in the
  object store of the producing worker's node and moves worker-to-worker when the
  consumer's host fetches it: the driver never holds those bytes unless it calls
  :meth:`DRef.get`;
- a smaller result is returned inline to the caller, so it is held in the driver's
  process memory (the driver owns the ref) and travels driver -> consumer inside the
  consuming call. For small results this is cheaper than the object store.
"""

from __future__ import annotations

from typing import Any

import ray


class DRef(list):
    """Per-rank results of one call: a ``list`` of one ``ray.ObjectRef`` per producing
    rank, in rank order, so ``ray.get(dref)`` and ``ray.wait(dref)`` take it as they
    take any list of references (as DLRover's non-blocking calls return them).

    Attributes:
        refs: the references as a plain list (the same items as the ``DRef`` itself).
        role, method: where they came from (for messages).
        merged: when consumed whole, concatenate the per-rank results (lists or
            tensors) instead of passing a list of them.
    """

    def __init__(self, refs: list, role: str = "", method: str = "", merged: bool = False,
                 _shard: int | None = None) -> None:
        super().__init__(refs)
        self.role, self.method, self.merged, self._shard = role, method, merged, _shard

    @property
    def refs(self) -> list:
        return list(self)

    def __repr__(self) -> str:
        return f"DRef(role={self.role!r}, method={self.method!r}, refs={list(self)!r})"

    def get(self, timeout: float | None = None) -> list:
        """Fetch the results into this process (through the driver). Rank order."""
        return ray.get(self.refs, timeout=timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """True when every rank's result is ready within ``timeout`` s."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        return len(ready) == len(self.refs)

    def concat(self) -> DRef:
        """A view that the consumer receives as one concatenated list / tensor."""
        return DRef(self.refs, self.role, self.method, True)

    def shard(self, i: int) -> DRef:
        """The consumer gets only the ``i``-th rank's result."""
        return DRef([self.refs[i]], self.role, self.method, False, i)

    def _fetch_local(self) -> Any:
        """Called in the consuming worker: fetch from the producers' object stores."""
        values = ray.get(self.refs)
        if self._shard is not None:
            return values[0]
        if self.merged:
            return merge(values)
        return values


def merge(values: list) -> Any:
    """Concatenate per-rank results: lists/tuples are chained, tensors and arrays
    concatenated on dim 0, dicts merged key-wise; anything else stays a list."""
    if not values:
        return values
    first = values[0]
    if isinstance(first, (list, tuple)):
        return [x for v in values for x in v]
    mod = type(first).__module__
    if mod.startswith("torch"):
        import torch

        return torch.cat(values, dim=0)
    if mod.startswith("numpy"):
        import numpy as np

        return np.concatenate(values, axis=0)
    if isinstance(first, dict):
        return {k: merge([v[k] for v in values]) for k in first}
    return values
