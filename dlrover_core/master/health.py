"""What the plugins see wrong with a running job outside its processes, polled by the
JobMaster: a flash persister that cannot write the checkpoint folder (a full disk), say.

:class:`HealthWatch` runs one daemon thread while the job runs. Every
:data:`HEALTH_INTERVAL_S` it calls the ``dlrover_job_health`` hook
(:meth:`dlrover_core.plugins.manager.PluginManager.job_health`) and keeps what the
plugins answered: ``status()["health"]`` (``{check: details}``, ``{}`` when all is
well) and two events, ``health_failing`` when a check starts failing (with its
details) and ``health_recovered`` when it stops (with how long it failed, s). A hook
that raises is logged and counts as no answer: it never stops the job.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: seconds between two polls of the ``dlrover_job_health`` hook
HEALTH_INTERVAL_S = 10.0


class HealthWatch:
    """Polls ``pm.job_health(job, spec)`` every ``interval_s`` seconds (see the module
    docstring).

    Args:
        pm: the plugin manager. job: the job's name. spec: its spec (passed to the hook).
        emit: ``emit(event, **fields)`` of the job's event log.
        interval_s: seconds between polls (> 0).
    Raises:
        ValueError: ``interval_s`` is not above 0.
    """

    def __init__(self, pm: Any, job: str, spec: Any, emit: Callable[..., Any],
                 interval_s: float = HEALTH_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"health interval_s {interval_s!r}; allowed: seconds > 0")
        self.pm, self.job, self.spec, self.emit = pm, job, spec, emit
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._failing: dict[str, dict] = {}
        self._since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start polling (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="job-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop polling; a check still failing stays in :meth:`current`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 30)

    def current(self) -> dict[str, dict]:
        """``{check: details}`` of the checks failing at the last poll."""
        with self._lock:
            return {k: dict(v) for k, v in self._failing.items()}

    def poll(self) -> dict[str, dict]:
        """Ask the plugins once, record the changes (events); returns :meth:`current`."""
        try:
            now = dict(self.pm.job_health(self.job, self.spec) or {})
        except Exception as exc:  # noqa: BLE001 - a plugin's bug must not stop the job
            log.warning("the dlrover_job_health hook failed: %s: %s", type(exc).__name__, exc)
            return self.current()
        t = time.time()
        with self._lock:
            started = {k: v for k, v in now.items() if k not in self._failing}
            ended = [k for k in self._failing if k not in now]
            for k in started:
                self._since[k] = t
            ended_for = {k: t - self._since.pop(k, t) for k in ended}
            self._failing = now
        for k, details in sorted(started.items()):
            log.warning("job %s: %s fails: %s", self.job, k, details)
            self.emit("health_failing", check=k, details=details)
        for k, seconds in sorted(ended_for.items()):
            log.warning("job %s: %s recovered after %.0f s", self.job, k, seconds)
            self.emit("health_recovered", check=k, failed_s=round(seconds, 3))
        return self.current()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
