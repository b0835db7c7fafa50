"""The built-in failure classifier (registered ``trylast``: plugins answer first).

Rules, in order:

1. ``node_lost`` -> ``node``.
2. User code raised during ``setup`` (before its first step) with an error that a
   restart cannot fix (ImportError, SyntaxError, TypeError, NameError,
   AttributeError, a config or spec error) -> ``fatal``.
3. The same exception type and message at the same step as an earlier failure of
   the same role -> the error is deterministic: ``role`` the first time it repeats
   (a clean restart of the whole role), ``fatal`` when it repeats again.
4. A script role's script ended by a signal (``ScriptExitError``: SIGKILL, SIGTERM ...)
   -> ``process``, said to come from outside the job (not an error in its code).
   A broken collective (gloo/NCCL connection closed or reset, timeout) -> ``process``.
5. A dead actor or process, a hang, a straggler (``node_health.straggler_action:
   replace``), any other exception -> ``process``.
"""

from __future__ import annotations

import re

from dlrover_core.plugins.records import Failure, FailureVerdict

FATAL_AT_SETUP = {
    "ImportError", "ModuleNotFoundError", "SyntaxError", "IndentationError", "TypeError",
    "NameError", "AttributeError", "dlrover_core.spec.errors.SpecError",
    "omegaconf.errors.ConfigKeyError", "omegaconf.errors.ConfigAttributeError",
    "omegaconf.errors.MissingMandatoryValue", "NotImplementedError",
}

COLLECTIVE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "connection reset",
    "Broken pipe", "NCCL", "gloo", "ProcessGroup", "timed out", "Timeout",
)


def is_broken_collective(failure: Failure) -> bool:
    """Whether ``failure`` is user code that raised from a broken collective (a peer
    closed or reset the connection, a timeout): often a survivor reporting a dead peer
    before the peer's own death is seen; or a survivor the master stopped for a peer's
    failure (``dlrover_core.runtime.attempt_stop.AttemptAborted``)."""
    return failure.kind == "user_error" and (
        any(m in failure.message for m in COLLECTIVE_MARKERS)
        or _short(failure.exc_type) == "AttemptAborted")


#: a script role's exit by a signal (``ScriptExitError``: "... ended with signal SIGKILL (9)")
_SCRIPT_SIGNAL = re.compile(r"ended with signal (SIGKILL|SIGTERM|SIGINT|SIGHUP|SIGQUIT|SIGABRT"
                            r"|SIGSEGV|SIGBUS) \(")


def _short(exc_type: str) -> str:
    return exc_type.rsplit(".", 1)[-1]


def _when(step: int) -> str:
    """Where the user's code was: ``step`` is the last step the instance reported, so
    the failure came in the step after it."""
    return f"after step {step}" if step >= 0 else "before its first reported step"


def classify(failure: Failure, history: list[Failure]) -> FailureVerdict:
    if failure.kind == "node_lost":
        return FailureVerdict("node", f"node {failure.node_id[:12]} left the cluster")
    if failure.kind == "user_error":
        if failure.phase == "setup" and (failure.exc_type in FATAL_AT_SETUP
                                         or _short(failure.exc_type) in FATAL_AT_SETUP):
            return FailureVerdict(
                "fatal", f"{failure.role}-{failure.rank} raised {failure.exc_type} before its "
                f"first step: a bug or bad config that a restart cannot fix")
        same = [f for f in history if f.kind == "user_error" and f.role == failure.role
                and f.exc_type == failure.exc_type and f.message == failure.message
                and f.step == failure.step and f.attempt < failure.attempt]
        if len(same) >= 2:
            return FailureVerdict(
                "fatal", f"{failure.exc_type} {_when(failure.step)} repeated after "
                f"{len(same)} restarts: deterministic")
        if same:
            return FailureVerdict(
                "role", f"{failure.exc_type} {_when(failure.step)} happened again after a "
                "restart; restarting the whole role once more")
        signalled = _SCRIPT_SIGNAL.search(failure.message)
        if _short(failure.exc_type) == "ScriptExitError" and signalled:
            return FailureVerdict(
                "process", f"{failure.role}-{failure.rank}'s script was killed by "
                f"{signalled.group(1)} {_when(failure.step)}, from outside the job (another "
                "process, or the kernel's OOM killer): not an error in its code")
        if is_broken_collective(failure):
            return FailureVerdict("process", f"broken collective: {failure.message[:120]}")
        return FailureVerdict("process", f"{failure.exc_type} in user code {_when(failure.step)}")
    if failure.kind == "straggler":
        return FailureVerdict("process", f"{failure.role}-{failure.rank} is a straggler: "
                              f"{failure.message[:160]}")
    if failure.kind == "hang":
        return FailureVerdict("process", f"{failure.role} reported no step for the hang timeout")
    return FailureVerdict("process", f"{failure.role}-{failure.rank} died: {failure.message[:160]}")
