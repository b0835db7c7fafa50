"""``RoleGroup``: call a method on every instance of a role from the driver.

``self.RG_ACTOR.update(batch)`` calls ``update`` on all actor ranks (or rank 0),
with the :class:`InvocationOptions` its ``@trainer_invocation`` declares, or the
defaults. ``self.RG_ACTOR.update.options(blocking=False)(batch)`` overrides them
for one call.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import ray

from dlrover_core.runtime.dref import DRef
from dlrover_core.runtime.errors import InvocationTimeout
from dlrover_core.runtime.invocation import DEFAULT_OPTIONS, InvocationOptions


def chunk_bounds(n_items: int, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``n`` contiguous, near-equal chunks of ``n_items`` (the
    first ``n_items % n`` chunks one larger): how a role group splits a list over
    ``n`` ranks (scatter dispatch)."""
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
    return [value[a:b] for a, b in chunk_bounds(length, n)]


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


# Methods of the hosting actor that a WorkloadActorHandle reaches directly
# (liveness and placement read-back) unless the workload defines the same name.
_HOST_METHODS = frozenset({"node_info", "ping", "progress"})


class _RemoteMethod:
    def __init__(self, handle: Any, method: str, host_level: bool) -> None:
        self._handle, self._method, self._host_level = handle, method, host_level

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Start the call; returns Ray's ``ObjectRef`` of the result."""
        if self._host_level:
            return getattr(self._handle, self._method).remote(*args, **kwargs)
        return self._handle.call.remote(self._method, *args, **kwargs)

    def options(self, **ray_options: Any) -> _RemoteMethod:
        """Ray's per-call options (e.g. ``name``) for this call."""
        handle = self._handle
        if self._host_level:
            return _OptionedHostMethod(getattr(handle, self._method).options(**ray_options))
        return _OptionedHostMethod(handle.call.options(**ray_options), self._method)


class _OptionedHostMethod:
    def __init__(self, bound: Any, method: str | None = None) -> None:
        self._bound, self._method = bound, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._method is None:
            return self._bound.remote(*args, **kwargs)
        return self._bound.remote(self._method, *args, **kwargs)


class WorkloadActorHandle:
    """One role instance as seed ``004``'s ``actor_handles`` show it:
    ``h.update.remote(x)`` runs ``workload.update(x)`` in that instance and returns
    Ray's ``ObjectRef`` (``ray.get`` it). No ``@trainer_invocation`` options apply:
    this is the raw, per-instance path; use ``RG_<ROLE>`` for sharding and waiting.

    Attributes:
        role, rank: which instance. actor: the hosting Ray actor handle.
    """

    def __init__(self, actor: Any, role: str, rank: int, workload_cls: type | None = None) -> None:
        self.actor, self.role, self.rank = actor, role, rank
        self._cls = workload_cls

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        host_level = method in _HOST_METHODS and not (
            self._cls is not None and callable(getattr(self._cls, method, None)))
        return _RemoteMethod(self.actor, method, host_level)

    def __repr__(self) -> str:
        return f"WorkloadActorHandle({self.role!r}, rank={self.rank})"


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

    def rebind(self, rank: int, handle: Any) -> None:
        """Point rank ``rank`` at ``handle`` (the actor that replaced a failed one; the
        driver kept running)."""
        self.handles[rank] = handle

    def dead_ranks(self, timeout: float = 5.0) -> list[int]:
        """Ranks whose actor is gone (its ``ping`` raises Ray's actor-death error);
        a rank that is alive but does not answer within ``timeout`` s is not dead."""
        probes = {h.ping.remote(): r for r, h in enumerate(self.handles)}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                dead.append(probes[ref])
        return sorted(dead)

    def await_replacement(self, master: Any, rank: int, timeout: float = 600.0,
                          poll_s: float = 0.1) -> Any:
        """Wait until the JobMaster has replaced rank ``rank`` (a new actor in the slot,
        set up: ``JobMaster.role_instance`` says ``running``), rebind to it and return
        its handle.

        Raises:
            TimeoutError: no replacement within ``timeout`` s (the master chose another
                recovery, e.g. a restart of the driver, or ran out of restarts).
        """
        old = self.handles[rank]
        deadline = time.monotonic() + timeout
        while True:
            info = ray.get(master.role_instance.remote(self.role, rank))
            handle = (info or {}).get("handle")
            if (handle is not None and info["state"] == "running"
                    and handle._actor_id != old._actor_id):
                self.rebind(rank, handle)
                return handle
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role}-{rank} was not replaced within {timeout} s "
                                   f"(the master's slot: {info and info['state']})")
            time.sleep(poll_s)

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
