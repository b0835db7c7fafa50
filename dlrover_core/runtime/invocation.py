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
    *,
    pre_function: Callable[..., Any] | None = None,
    post_function: Callable[[Any], Any] | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate a workload method with its :class:`InvocationOptions`.

    ``pre_function`` / ``post_function`` are the names seed ``004``'s example uses:
    aliases of ``pre_func`` / ``post_func`` (give one of each pair, not both).

    Raises:
        ValueError: bad ``target`` or ``timeout``, or both names of an alias pair.

    Example::

        class Rollout(BaseWorkload):
            @trainer_invocation(blocking=False)
            def generate(self, prompts): ...
    """
    for name, a, b in (("pre_func", pre_func, pre_function), ("post_func", post_func, post_function)):
        if a is not None and b is not None:
            raise ValueError(f"trainer_invocation: give {name} or its alias "
                             f"{name.replace('func', 'function')}, not both")
    opts = InvocationOptions(blocking, is_async, timeout, target, auto_shard,
                             pre_func or pre_function, post_func or post_function)

    def deco(fn: Callable) -> Callable:
        setattr(fn, _ATTR, opts)
        return fn

    return deco


# driven by the host itself (setup before the first call, teardown at the end,
# warm_up in a standby); never callable through ``WorkloadHost.call``
LIFECYCLE_METHODS = frozenset({"setup", "teardown", "warm_up"})


def remote_methods(cls: type) -> list[str]:
    """Names of the methods of ``cls`` that a driver may call through a role group:
    public (no leading ``_``), defined as functions (plain, static or class methods;
    properties and data attributes are not methods), minus :data:`LIFECYCLE_METHODS`.
    Sorted."""
    out = []
    for name in dir(cls):
        if name.startswith("_") or name in LIFECYCLE_METHODS:
            continue
        attr = inspect.getattr_static(cls, name, None)
        if isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr):
            out.append(name)
    return sorted(out)


def resolve_remote_method(workload: Any, method: Any) -> Callable[..., Any]:
    """The bound method ``workload.<method>`` if a driver may call it (see
    :func:`remote_methods`).

    Raises:
        AttributeError: ``method`` is not a string, is private or a dunder
            (``"__setattr__"``), is a lifecycle method, names a property or a data
            attribute, or does not exist; the message lists the callable methods.
    """
    cls = type(workload)
    allowed = remote_methods(cls)
    if not isinstance(method, str) or method not in allowed:
        if isinstance(method, str) and method.startswith("_"):
            why = "private and dunder names are not callable remotely"
        elif method in LIFECYCLE_METHODS:
            why = "lifecycle methods are called by dlrover only"
        elif isinstance(method, str) and hasattr(cls, method):
            why = "it is not a method (a property or a data attribute)"
        else:
            why = "no such method"
        raise AttributeError(
            f"{cls.__name__}.{method!s}: not callable through a role group ({why}); "
            f"allowed: the public methods of the workload: {', '.join(allowed) or '(none)'}")
    return getattr(workload, method)


def collect_invocations(cls: type) -> dict[str, InvocationOptions]:
    """Options of every decorated public method of ``cls``."""
    out = {}
    for name, fn in inspect.getmembers(cls, predicate=callable):
        opts = getattr(fn, _ATTR, None)
        if opts is not None and not name.startswith("_"):
            out[name] = opts
    return out
