"""The framework's own lines in each attempt's log (``logs/<role>-<rank>/attempt-<N>.log``).

An attempt's log starts with where and how the rank runs (role, rank, world size,
local rank, node, device, backend, attempt), then holds a line per checkpoint restore
(the step and the saver it came from) and per save, and ends with why the attempt
ended (``run()`` returned, or the exception). The workload's own :mod:`logging`
records (level INFO and up) and its :mod:`warnings` land in the same file: a handler
on the root logger writes to stderr, which :mod:`dlrover_core.runtime.log_capture`
sends to the attempt's file.

A process killed by a signal (SIGKILL, a lost node) writes no closing line; the
failure is in the job's ``events.jsonl`` (``instance_failed``) and ``dlrover status``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

#: The logger of the framework's lines in a worker process.
log = logging.getLogger("dlrover.worker")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_dlrover_attempt_handler"


def install(level: int = logging.INFO) -> None:
    """Route :mod:`logging` records of ``level`` and up, and :mod:`warnings`, to this
    process's stderr (captured into the attempt's log). Idempotent."""
    root = logging.getLogger()
    if not any(getattr(h, _MARK, False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    logging.captureWarnings(True)


def header(ctx: Any) -> None:
    """The opening lines of an attempt, from the worker context ``ctx``."""
    try:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        node_id, node_ip = "-", "-"
    device = f"cuda:{ctx.cuda_device}" if getattr(ctx, "cuda_device", None) is not None \
        else "cpu"
    log.info("attempt %s of %s rank %s/%s (local rank %s/%s, node rank %s) of job %s",
             ctx.attempt, ctx.role, ctx.rank, ctx.world_size, ctx.local_rank,
             ctx.local_world_size, getattr(ctx, "node_rank", None), ctx.job)
    log.info("node %s (%s, ray node %s) pid %s; device %s (gpu ids %s); backend %s, "
             "rendezvous %s:%s", socket.gethostname(), node_ip, node_id[:12], os.getpid(),
             device, list(getattr(ctx, "gpu_ids", []) or []), ctx.backend or "none",
             getattr(ctx, "master_addr", "-"), getattr(ctx, "master_port", "-"))


def restored(step: int | None, source: str) -> None:
    if step is None:
        log.info("checkpoint: nothing to restore from %s; starting from scratch", source)
    else:
        log.info("checkpoint: restored step %s from %s", step, source)


def saved(step: int, source: str, seconds: float) -> None:
    log.info("checkpoint: saved step %s to %s (%.3f s blocking)", step, source, seconds)


def ended(step: int, exc: BaseException | None = None) -> None:
    """The closing line: ``run()`` returned (``step``: the last reported step), or
    raised ``exc``."""
    if exc is None:
        log.info("attempt ended: run() returned at step %s", step)
    else:
        log.error("attempt ended: %s: %s (last reported step %s)", type(exc).__name__,
                  str(exc).splitlines()[0][:300] if str(exc) else "", step)


def saver_source(saver: Any) -> str:
    """A saver's name and where it keeps checkpoints (its ``directory``/``dir``/``path``)."""
    config = getattr(saver, "config", None)
    where = getattr(config, "dir", None) if config is not None else None
    if not isinstance(where, str):
        try:
            where = config.get("dir")  # a plain dict
        except AttributeError:
            where = None
    name = type(saver).__name__
    return f"{name} {where}" if where else name
