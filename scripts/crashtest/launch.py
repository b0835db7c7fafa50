"""Rank processes: each phase's ranks are fresh processes, forked from a forkserver
that imported torch and the savers once (a process costs milliseconds, not the 2-3 s
of an interpreter that imports torch), started together, read together, and killed
(SIGKILL) when the phase overruns its timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait
from typing import Any

_CTX: Any = None

#: modules the forkserver imports before it forks a rank (one missing is skipped);
#: importing them in every rank instead cost 2-3 s of CPU per process
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "ray",
           "dlrover_core.checkpoint.disk", "dlrover_core.checkpoint.checkpointer",
           "dlrover_core.master.client", "dlrover_plugin_flashckpt.saver",
           "dlrover_plugin_flashckpt.persister", "dlrover_plugin_odl.workloads",
           "crashtest.ranks", "crashtest.disk_case", "crashtest.flash_case",
           "crashtest.odl_case"]


def context(extra_preload: list[str] | None = None) -> Any:
    """The forkserver context (made once per harness process)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD + list(extra_preload or []))
    return _CTX


def run_phase(specs: list[dict], timeout: float) -> list[dict]:
    """Start one process per spec (:func:`crashtest.ranks.rank_main`), collect what
    each reports until every one has ended or ``timeout`` s passed, then kill what is
    left. Returns per rank ``{"rank", "results", "done", "warnings", "exitcode",
    "killed", "hung", ...}`` (``killed``: died of SIGKILL; ``hung``: killed by the
    harness at the timeout)."""
    from crashtest.ranks import rank_main

    ctx = context()
    procs, conns = [], []
    for spec in specs:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=rank_main, args=(child, spec), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    out = [{"rank": s["rank"], "results": [], "done": False, "warnings": [], "hung": False}
           for s in specs]
    open_conns = dict(enumerate(conns))
    deadline = time.monotonic() + timeout
    while open_conns and time.monotonic() < deadline:
        ready = wait(list(open_conns.values()), timeout=max(0.0, deadline - time.monotonic()))
        for k in [k for k, c in open_conns.items() if c in ready]:
            try:
                msg = open_conns[k].recv()
            except (EOFError, OSError):
                del open_conns[k]
                continue
            if msg.get("done"):
                out[k].update(msg)
            else:
                out[k]["results"].append(msg)
    for k, p in enumerate(procs):
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            out[k]["hung"] = True
            os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        out[k]["exitcode"] = p.exitcode
        out[k]["killed"] = p.exitcode == -signal.SIGKILL and not out[k]["hung"]
        out[k]["pid"] = p.pid
    for c in conns:
        c.close()
    return out
