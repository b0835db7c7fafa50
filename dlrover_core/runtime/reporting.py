"""``StepReporter``: how a worker's step reports reach the JobMaster without flooding it.

Every ``BaseWorkload.report(step, **metrics)`` used to be one Ray call to the master,
so N ranks stepping at R Hz cost the master N x R calls per second. Now:

- **rank 0** of a role sends every report at once: its metrics are the job's metrics
  (progress bar, ``metrics.jsonl``, ``summary.json``);
- **every other rank** coalesces: ``report()`` only records the newest step, its unix
  time and metrics; a daemon thread sends the newest one when it changed, at most once
  per :func:`report_interval_s`. A step is therefore known to the master at most one
  interval after it ended, and the last step before a rank stops (hangs, blocks in a
  collective) still arrives, with the time it ended: the master can blame the rank
  whose progress stopped first;
- with a ``relay`` (:mod:`dlrover_core.runtime.node_reporter`, in roles of many ranks)
  a non-zero rank hands those coalesced reports to its node's agent, which forwards
  the newest of all its ranks in one call per interval; a failed agent makes the rank
  send directly. :meth:`StepReporter.flush` (a run's end) and :meth:`StepReporter.close`
  always send directly.

Before anything is sent, :class:`~dlrover_core.tuning.metrics.StepClock` fills in the
step's ``step_s``, ``comm_wait_s`` and ``compute_s`` where the report lacks them, once a
DDP model of this process measures its gradient all-reduce
(:func:`~dlrover_core.tuning.metrics.measure_comm_wait`; the ``ddp`` backend does it):
every rank's own compute and collective wait reach the master, from workloads and from
scripts (``script_api.report_step``) that time nothing themselves.

The master's report rate is then about ``roles + sum(world_size / interval)``; with the
default budget of :data:`COALESCED_REPORTS_PER_S` per role it stays near that budget
whatever the world size (up to the :data:`MAX_INTERVAL_S` cap).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

#: Reports per second that the non-zero ranks of one role may send to the master, in all.
COALESCED_REPORTS_PER_S = 100.0
#: Bounds of the per-rank interval (s).
MIN_INTERVAL_S = 0.5
MAX_INTERVAL_S = 10.0


def report_interval_s(world_size: int, hang_timeout_s: float = 0.0) -> float:
    """Seconds between two reports of one non-zero rank: ``world_size /
    COALESCED_REPORTS_PER_S`` clamped to [``MIN_INTERVAL_S``, ``MAX_INTERVAL_S``], and at
    most a quarter of ``hang_timeout_s`` (when > 0) so hang detection stays accurate.

    Raises:
        ValueError: ``world_size`` < 1 or ``hang_timeout_s`` < 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; allowed: >= 1")
    if hang_timeout_s < 0:
        raise ValueError(f"hang_timeout_s={hang_timeout_s!r} is invalid; allowed: >= 0")
    interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, world_size / COALESCED_REPORTS_PER_S))
    if hang_timeout_s > 0:
        interval = min(interval, max(0.05, hang_timeout_s / 4))
    return interval


class StepReporter:
    """Sends one rank's step reports to the master (see the module docstring).

    Args:
        send: ``send(step, metrics, ts)`` delivers one report (non-blocking; in a worker,
            ``master.report.remote(role, rank, ...)``).
        rank: this rank; 0 sends every report at once.
        interval_s: seconds between coalesced sends of the other ranks.
        relay: a :class:`~dlrover_core.runtime.node_reporter.NodeRelay` the coalesced
            reports of a non-zero rank go through (``None``: directly by ``send``).
    """

    def __init__(self, send: Callable[[int, dict, float], Any], rank: int,
                 interval_s: float, relay: Any = None) -> None:
        self._send = send
        self._relay = relay if rank != 0 else None
        self._master_step: int | None = None  # the newest step ``send`` sent
        self.rank = rank
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._latest: tuple[int, dict, float] | None = None
        self._sent_step: int | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        #: what the newest ``send`` returned (in a worker: the ObjectRef of the master's
        #: ``report`` call, which a host waits on before its run returns)
        self.last_sent: Any = None
        from dlrover_core.tuning.metrics import StepClock

        self._clock = StepClock()

    def report(self, step: int, metrics: dict, ts: float | None = None) -> None:
        """Record that ``step`` ended (``ts``: unix s, default now) with ``metrics``
        (timing filled in by ``StepClock``: module doc)."""
        ts = time.time() if ts is None else ts
        metrics = self._clock.fill(step, metrics)
        if self.rank == 0:
            self._deliver(step, metrics, ts)
            return
        with self._lock:
            self._latest = (step, metrics, ts)
        if self._thread is None:
            self._deliver(step, metrics, ts)  # the first report goes at once
            self._thread = threading.Thread(target=_pump, args=(weakref.ref(self),),
                                            name="dlrover-step-reporter", daemon=True)
            self._thread.start()

    def flush(self) -> None:
        """Send the newest report now, directly, if ``send`` did not send it yet."""
        with self._lock:
            latest = self._latest
        if latest is not None and latest[0] != self._master_step:
            self._deliver(*latest, direct=True)

    def _flush_due(self) -> None:
        """The coalescing thread's send: the newest report if it is new, or if its
        relay lost it."""
        with self._lock:
            latest = self._latest
        if latest is None:
            return
        lost = self._relay is not None and self._relay.lost()
        if lost or latest[0] != self._sent_step:
            self._deliver(*latest)

    def close(self) -> None:
        """Send what is pending and stop the thread."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._wake.set()

    def _deliver(self, step: int, metrics: dict, ts: float, direct: bool = False) -> None:
        self._sent_step = step
        self.sent += 1
        relay = self._relay
        if not direct and relay is not None and not relay.lost() and relay.push(
                step, metrics, ts):
            return
        self._master_step = step
        self.last_sent = self._send(step, metrics, ts)


def _pump(ref: weakref.ref) -> None:
    """The coalescing thread: holds only a weak reference, so a dropped reporter ends it."""
    while True:
        reporter = ref()
        if reporter is None or reporter._closed:
            return
        wake, interval = reporter._wake, reporter.interval_s
        del reporter
        wake.wait(interval)
        reporter = ref()
        if reporter is None or reporter._closed:
            return
        try:
            reporter._flush_due()
        except Exception:  # noqa: BLE001 - the master is restarting; the next send retries
            pass
        del reporter
