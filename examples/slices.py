"""Pausing a training job from outside at a step boundary, for benchmarks that run two
jobs in alternating slices on one machine (``benchmarks/tuning.py --sliced``), so that
a drift of the machine's speed hits both alike.

A job whose ``config.pause_file`` names a path checks it before each step
(:func:`wait_while_paused`; the ranks agree through one small all-reduce): while the
file exists, each rank writes
``<pause_file>.rank<r>`` (the step it stopped before, and the time) and waits; when the
file is gone it removes its note, tells its step timer how long it stood still
(:meth:`~dlrover_core.tuning.metrics.StepTimer.note_pause`: the pause is out of its
``interval_s``, ``samples_per_s`` and the tuner's windows) and goes on. The controller
side is :class:`PauseControl`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: seconds between two looks at the pause file while paused
POLL_S = 0.02


def _agreed(seen: bool) -> bool:
    """Whether any rank of the default process group saw the pause file (an all-reduce
    of one int: every rank stops before the same step, or none does; a rank that went
    on alone would wait in the step's first collective for one that stopped)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seen
    t = torch.tensor([1 if seen else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def wait_while_paused(config: Any, rank: int, step: int, timer: Any = None) -> float:
    """Before ``step``, on every rank: wait while ``config.pause_file`` exists (nothing
    without the key; with it, one small all-reduce per step so that the ranks agree).
    Returns the seconds paused (also given to ``timer.note_pause`` when a timer is
    passed)."""
    path = config.get("pause_file") if config is not None else None
    if not path or not _agreed(os.path.exists(str(path))):
        return 0.0
    note = f"{path}.rank{rank}"
    t0 = time.monotonic()
    tmp = f"{note}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "step": step, "ts": time.time()}, f)
    os.replace(tmp, note)
    while os.path.exists(str(path)):
        time.sleep(POLL_S)
    paused = time.monotonic() - t0
    try:
        os.unlink(note)
    except FileNotFoundError:
        pass
    if timer is not None:
        timer.note_pause(paused)
    return paused


class PauseControl:
    """Pause and resume one job whose ranks call :func:`wait_while_paused` with
    ``config.pause_file = path`` (``ranks``: its number of ranks)."""

    def __init__(self, path: str, ranks: int) -> None:
        self.path, self.ranks = path, ranks

    def pause(self, timeout_s: float = 300.0) -> dict:
        """Ask the job to stop at its next step boundary and wait until every rank
        stopped. Returns ``{"step": the step the ranks stopped before (the lowest), "ts":
        unix time the last rank stopped}``.

        Raises:
            TimeoutError: not every rank stopped within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        # the notes of the previous pause are gone once every rank went on
        while any(os.path.exists(f"{self.path}.rank{r}") for r in range(self.ranks)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: a rank did not go on after the last pause")
            time.sleep(POLL_S)
        open(self.path, "w").close()
        return self.wait_paused(max(0.0, deadline - time.monotonic()))

    def wait_paused(self, timeout_s: float = 300.0) -> dict:
        """Wait until every rank stands still at the pause that is asked now (a job
        submitted with the pause file present: its ranks stop before their first step);
        returns what :meth:`pause` returns.

        Raises:
            TimeoutError: not every rank stopped within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            notes = []
            for r in range(self.ranks):
                try:
                    with open(f"{self.path}.rank{r}") as f:
                        notes.append(json.load(f))
                except (FileNotFoundError, json.JSONDecodeError):
                    break
            if len(notes) == self.ranks:
                return {"step": min(n["step"] for n in notes),
                        "ts": max(n["ts"] for n in notes)}
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.path}: not every one of {self.ranks} ranks paused "
                           f"within {timeout_s} s")

    def resume(self) -> float:
        """Let the job go on; returns the unix time of the resume."""
        ts = time.time()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return ts
