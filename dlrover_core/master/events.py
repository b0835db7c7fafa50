"""``events.jsonl``: one JSON object per lifecycle event, appended and flushed."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Any, Callable


class EventLog:
    """Append-only JSON-lines log of a job (``events.jsonl``; ``metrics.jsonl`` holds the
    ``step`` records of rank 0 and the driver).

    Each line: ``{"ts": <unix s>, "event": <name>, ...fields}``. Events: ``job_started``,
    ``placement``, ``instance_started``, ``instance_failed``, ``failure_classified``,
    ``recovery_started``, ``recovery_finished``, ``checkpoint_saved``, ``instance_finished``,
    ``master_restarted``, ``master_reattached``, ``standby_unusable``, ``standby_died``
    (``role``, ``actor``, ``reason``: a warm spare died and is replaced), ``standby_ready``
    (``role``, ``actor``, ``prepare_s``: a spare finished warming up), ``job_state_changed``
    (``previous``, ``state``: every transition of the job's state), ``job_finished``;
    node health (docs/node-health.md): ``node_check``, ``node_check_skipped``,
    ``node_check_kept``, ``straggler_detected``, ``hang_stacks``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)
        self._listeners: list[Callable[[dict], None]] = []

    def add_listener(self, listener: Callable[[dict], None]) -> None:
        """Call ``listener(record)`` after each record is written, in the emitting thread
        (e.g. the TensorBoard writer of ``observability.tensorboard``). An exception in
        a listener is printed and ignored: it never breaks the job."""
        self._listeners.append(listener)

    def emit(self, event: str, **fields: Any) -> dict:
        rec = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(rec, default=str, sort_keys=False)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
        for listener in self._listeners:
            try:
                listener(rec)
            except Exception:  # noqa: BLE001 - observability must not break the job
                traceback.print_exc()
        return rec

    def sync(self) -> None:
        with self._lock:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()


def read_events(path: str) -> list[dict]:
    """All events of a job directory's ``events.jsonl`` (a torn last line is skipped)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
