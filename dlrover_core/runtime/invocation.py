"""``@trainer_invocation``: how a driver calls a workload method through a role group."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

TARGETS = ("ALL", "RANK0")


@dataclass(frozen=True)
class InvocationOptions:
    """Options of one workload method, as seen by ``RoleGroup`` (seed ``004``).

    Attributes:
        blocking: wait for the results (True) or return a ``DRef`` at once (False).
        is_async: when blocking, wait with ``ray.wait`` and ``timeout`` instead of
            ``ray.get``; the call raises ``InvocationTimeout`` if it does not finish.
        timeout: seconds to wait for a blocking call (``None``: forever; with
            ``is_async`` the default is 10 s).
        target: ``ALL`` ranks or ``RANK0`` only.
        auto_shard: split list / tuple / tensor / ndarray / ``DRef`` arguments into
            contiguous chunks along dim 0, one per target rank, in rank order.
        pre_func: ``pre_func(*args, **kwargs)`` runs in the driver first; its return
            value (a tuple for several arguments) becomes the arguments.
        post_func: ``post_func(results)`` runs in the driver on the list of results
            (rank order; the single result for ``RANK0``); its value is returned.
    """

    blocking: bool = True
    is_async: bool = False
    timeout: float | None = None
    target: str = "ALL"
    auto_shard: bool = True
    pre_func: Callable[..., Any] | None = None
    post_func: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"trainer_invocation target={self.target!r}; allowed: ALL, RANK0")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"trainer_invocation timeout={self.timeout!r}; allowed: seconds > 0")

    def with_(self, **overrides: Any) -> InvocationOptions:
        return replace(self, **overrides)

    @property
    def effective_timeout(self) -> float | None:
        if self.timeout is None and self.is_async:
            return 10.0
        return self.timeout


DEFAULT_OPTIONS = InvocationOptions()
_ATTR = "_dlrover_invocation"


def trainer_invocation(
    blocking: bool = True,
    is_async: bool = False,
    timeout: float | None = None,
    target: str = "ALL",
    auto_shard: bool = True,
    pre_func: Callable[..., Any] | None = None,
    post_func: Callable[[Any], Any] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate a workload method with its :class:`InvocationOptions`.

    Example::

        class Rollout(BaseWorkload):
            @trainer_invocation(blocking=False)
            def generate(self, prompts): ...
    """
    opts = InvocationOptions(blocking, is_async, timeout, target, auto_shard, pre_func, post_func)

    def deco(fn: Callable) -> Callable:
        setattr(fn, _ATTR, opts)
        return fn

    return deco


def collect_invocations(cls: type) -> dict[str, InvocationOptions]:
    """Options of every decorated public method of ``cls``."""
    out = {}
    for name, fn in inspect.getmembers(cls, predicate=callable):
        opts = getattr(fn, _ATTR, None)
        if opts is not None and not name.startswith("_"):
            out[name] = opts
    return out
