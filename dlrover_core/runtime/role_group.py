"""``RoleGroup``: call a method on every instance of a role from the driver.

``self.RG_ACTOR.update(batch)`` calls ``update`` on all actor ranks (or rank 0),
with the :class:`InvocationOptions` its ``@trainer_invocation`` declares, or the
defaults. ``self.RG_ACTOR.update.options(blocking=False)(batch)`` overrides them
for one call.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from dlrover_core.runtime.dref import DRef
from dlrover_core.runtime.errors import InvocationTimeout
from dlrover_core.runtime.invocation import DEFAULT_OPTIONS, InvocationOptions


def _chunk_bounds(n_items: int, n: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` bounds of ``n`` near-equal chunks (first ones larger)."""
    base, extra = divmod(n_items, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _shardable(value: Any) -> bool:
    if isinstance(value, (list, tuple, DRef)):
        return True
    mod = type(value).__module__
    return (mod.startswith("torch") or mod.startswith("numpy")) and hasattr(value, "shape") \
        and len(getattr(value, "shape", ())) > 0


def shard_value(value: Any, n: int, key: str) -> list[Any]:
    """Split ``value`` into ``n`` contiguous shards, in order.

    Lists, tuples, tensors and arrays split along dim 0 into near-equal chunks;
    a ``DRef`` of ``m`` results gives each target ``m / n`` of them.

    Raises:
        ValueError: fewer items than targets, or a ``DRef`` whose size is not a
            multiple of ``n``.
    """
    if isinstance(value, DRef):
        m = len(value)
        # one result per rank: pass Ray's own ObjectRef, which Ray resolves before the
        # call starts (the bytes move worker-to-worker, as with raw Ray)
        if m == n:
            return list(value.refs)
        if m == 1:
            return [value.refs[0]] * n
        if m % n:
            raise ValueError(f"auto_shard of argument {key}: a DRef of {m} results cannot be split "
                             f"over {n} ranks (need a multiple of {n}, or 1)")
        k = m // n
        return [DRef(value.refs[i * k:(i + 1) * k], value.role, value.method, True)
                for i in range(n)]
    length = len(value)
    if length < n:
        raise ValueError(f"auto_shard of argument {key}: {length} items cannot be split over "
                         f"{n} ranks; pass at least {n}, or call with .options(auto_shard=False)")
    return [value[a:b] for a, b in _chunk_bounds(length, n)]


class RoleMethod:
    """A bound ``RoleGroup`` method; call it, or ``.options(...)`` first."""

    def __init__(self, group: RoleGroup, method: str, options: InvocationOptions) -> None:
        self._group = group
        self._method = method
        self._options = options

    def options(self, **overrides: Any) -> RoleMethod:
        return RoleMethod(self._group, self._method, self._options.with_(**overrides))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._invoke(self._method, self._options, args, kwargs)


class RoleGroup:
    """All instances of one role, as the driver sees them.

    Args:
        role: role name. handles: ``WorkloadHost`` actor handles in rank order.
        invocations: method name -> options, from the workload's decorators.
    """

    def __init__(self, role: str, handles: Sequence[Any],
                 invocations: dict[str, InvocationOptions] | None = None) -> None:
        self.role = role
        self.handles = list(handles)
        self.invocations = dict(invocations or {})

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def __getattr__(self, method: str) -> RoleMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return RoleMethod(self, method, self.invocations.get(method, DEFAULT_OPTIONS))

    def __repr__(self) -> str:
        return f"RoleGroup({self.role!r}, world_size={self.world_size})"

    def _invoke(self, method: str, opts: InvocationOptions, args: tuple, kwargs: dict) -> Any:
        if opts.pre_func is not None:
            out = opts.pre_func(*args, **kwargs)
            args, kwargs = (out if isinstance(out, tuple) else (out,)), {}
        targets = self.handles[:1] if opts.target == "RANK0" else self.handles
        n = len(targets)
        if opts.auto_shard and n > 1:
            per_rank_args = [[] for _ in range(n)]
            for i, a in enumerate(args):
                parts = shard_value(a, n, f"#{i}") if _shardable(a) else [a] * n
                for r in range(n):
                    per_rank_args[r].append(parts[r])
            per_rank_kwargs: list[dict] = [{} for _ in range(n)]
            for k, v in kwargs.items():
                parts = shard_value(v, n, repr(k)) if _shardable(v) else [v] * n
                for r in range(n):
                    per_rank_kwargs[r][k] = parts[r]
            refs = [h.call.remote(method, *per_rank_args[r], **per_rank_kwargs[r])
                    for r, h in enumerate(targets)]
        else:
            refs = [h.call.remote(method, *args, **kwargs) for h in targets]
        if not opts.blocking:
            return DRef(refs, self.role, method)
        timeout = opts.effective_timeout
        if timeout is not None:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            if pending:
                raise InvocationTimeout(
                    f"{self.role}.{method}: {len(pending)} of {len(refs)} ranks did not finish "
                    f"within timeout={timeout} s")
        results = ray.get(refs)
        if opts.target == "RANK0":
            results = results[0]
        if opts.post_func is not None:
            results = opts.post_func(results)
        return results
