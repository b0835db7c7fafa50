"""Stopping a survivor's attempt where it computes, not at its next collective.

When a rank of a role with a process group fails, the master asks every survivor to
abort its collectives (:meth:`dlrover_core.runtime.host_base.HostBase.abort_collectives`)
and waits for its run to end. A survivor busy computing reaches no collective before
its step's gradient all-reduce, and DDP on gloo reports a failed all-reduce only when
the backward ends (the reducer waits for its buckets' futures there): on 2 cores the
survivor's part of a recovery (``abort_s`` of ``benchmarks/recovery.py``) was 0.18-0.23
s, about half a step. :func:`stop` makes the process's next module call (a global
forward pre-hook, armed only from then on) raise :class:`AttemptAborted`, and so does
the next gradient bucket of a DDP model whose communication hook calls :func:`check`
(``dlrover_core.tuning.comm_wait``'s, which the ``ddp`` backend registers): a step
without a failure runs no check but that one read of a module global per bucket.

Either stops the step before its optimizer step, as a failed collective of the step
would: the parameters and optimizer state stay those of the last completed step, which
a healing peer takes (``dlrover_core.checkpoint.heal``; the random state goes back to
the one noted with them). The re-setup in place (``WorkloadHost.setup``) calls
:func:`clear` before anything else.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
#: why this process's attempt was stopped (``None``: it was not, or it already raised)
_reason: str | None = None
#: the handle of the global forward pre-hook :func:`stop` armed
_forward_hook: Any = None


class AttemptAborted(RuntimeError):
    """Raised in a survivor's training thread after :func:`stop`: a peer of the rank
    failed and the master is recovering the role in place; this attempt ends."""


def stop(reason: str) -> None:
    """Make the next module call of this process (``nn.Module.__call__``, any module,
    any thread), or the next :func:`check` (a DDP gradient bucket), raise
    :class:`AttemptAborted`, once. Safe from any thread; a no-op while a stop is
    pending."""
    import torch

    global _reason, _forward_hook
    with _lock:
        if _reason is not None:
            return
        _reason = reason
        _forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: check(f"{type(module).__name__}'s forward"))


def clear() -> None:
    """Forget a pending :func:`stop` (a new attempt starts) and remove its hook."""
    global _reason, _forward_hook
    with _lock:
        _reason = None
        if _forward_hook is not None:
            _forward_hook.remove()
            _forward_hook = None


def pending() -> bool:
    """Whether a :func:`stop` has not raised yet."""
    return _reason is not None


def check(where: str) -> None:
    """Raise :class:`AttemptAborted` if a :func:`stop` is pending (and clear it).

    Raises:
        AttemptAborted: a stop was pending; ``where`` says at what point it was seen.
    """
    if _reason is None:
        return
    reason = _reason
    clear()
    raise AttemptAborted(f"{reason}: this attempt stopped at {where} (dlrover recovery "
                         "in place)")
