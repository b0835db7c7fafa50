"""The JobMaster of a script role's job, from inside its script
(:func:`script_master`): joins the job's Ray cluster and looks the master up once per
process, with the rank's identity from the environment a script role gives its script
(:data:`SCRIPT_ENV`). :mod:`dlrover_core.script_api` builds its reports on it;
``ShardSampler.for_script`` uses it."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any


#: The environment a script role gives its script that :func:`script_master` needs
#: (``dlrover_core/runtime/script.py``: ``WorkerContext.env`` and ``RAY_ADDRESS``).
SCRIPT_ENV = ("RAY_ADDRESS", "DLROVER_JOB", "DLROVER_ROLE", "RANK")


class NotInDlroverError(RuntimeError):
    """A dlrover service was asked for outside a dlrover job (no JobMaster to reach)."""


@dataclass(frozen=True)
class ScriptMaster:
    """The JobMaster of a script's job (a Ray actor handle) and who the script is:
    ``job``, ``role``, ``rank`` (``$RANK``), ``world_size`` (``$WORLD_SIZE``, 1 when
    unset) and ``attempt`` (the larger of ``$DLROVER_ATTEMPT``, the actor's restarts, and
    ``$TORCHELASTIC_RESTART_COUNT``, the script's; 0 when unset)."""

    master: Any
    job: str
    role: str
    rank: int
    world_size: int
    attempt: int


_lock = threading.Lock()
_cached: dict[tuple[str, str, str], ScriptMaster] = {}


def script_master(caller: str = "script_master",
                  hint: str = "outside dlrover, leave the call out") -> ScriptMaster:
    """The JobMaster of ``$DLROVER_JOB`` and this rank's identity: joins the job's Ray
    cluster (``ray.init(address=$RAY_ADDRESS)`` unless already joined) and looks the
    master actor up (once per process; later calls return the same object).

    Args:
        caller: names the API in the error; hint: what to do instead, in the error.
    Raises:
        NotInDlroverError: one of :data:`SCRIPT_ENV` is not set (naming the missing
            variables), or the cluster has no JobMaster of ``$DLROVER_JOB``.
        ValueError: ``$RANK`` is not an integer.
    """
    missing = [k for k in SCRIPT_ENV if not os.environ.get(k)]
    if missing:
        raise NotInDlroverError(
            f"{caller}: {', '.join(missing)} not set; the JobMaster is reachable only from "
            f"a dlrover script role (dlrover-run, or roles.<role>.command); {hint}")
    env = os.environ
    key = (env["RAY_ADDRESS"], env["DLROVER_JOB"], env["DLROVER_ROLE"])
    with _lock:
        if key in _cached:
            return _cached[key]
        import ray

        from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

        if not ray.is_initialized():
            if threading.current_thread() is not threading.main_thread():
                logging.getLogger("ray._private.worker").addFilter(_no_sigterm_warning)
            ray.init(address=env["RAY_ADDRESS"], log_to_driver=False,
                     logging_level="warning")
        job = env["DLROVER_JOB"]
        try:
            master = ray.get_actor(master_actor_name(job), namespace=MASTER_NAMESPACE)
        except ValueError as e:
            raise NotInDlroverError(f"{caller}: no JobMaster of job DLROVER_JOB={job!r} in "
                                    f"the cluster ({e})") from None
        found = _cached[key] = ScriptMaster(
            master, job, env["DLROVER_ROLE"], _int_env("RANK", None),
            _int_env("WORLD_SIZE", 1),
            max(_int_env("DLROVER_ATTEMPT", 0), _int_env("TORCHELASTIC_RESTART_COUNT", 0)))
        return found


def _no_sigterm_warning(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that ``ray.init`` off the main thread (the join of
    :func:`report_step`) sets no SIGTERM handler: the script keeps Python's default
    SIGTERM (the process ends), as under plain ``torchrun``."""
    return "SIGTERM handler is not set" not in record.getMessage()


def _int_env(key: str, default: int | None) -> int:
    v = os.environ.get(key)
    if v is None and default is not None:
        return default
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {key}={v!r} is invalid; allowed: an "
                         "integer") from None


def in_dlrover() -> bool:
    """Whether this process runs as a rank of a dlrover script role (every variable of
    :data:`SCRIPT_ENV` is set); nothing is contacted."""
    return all(os.environ.get(k) for k in SCRIPT_ENV)
