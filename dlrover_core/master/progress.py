"""Progress: what the master does with the workers' step reports and checkpoint notices.

``JobMaster.report`` and ``JobMaster.checkpoint_saved`` (the "report" concurrency
group: one at a time) land here. The master is a threaded Ray actor, and Ray runs a
threaded actor's calls out of order, so two reports of one sender can arrive swapped:
``metrics.jsonl`` is in arrival order, and the job's step only ever moves forward.
Rank 0's report moves the job's step and metrics, goes to ``metrics.jsonl`` and to the
``dlrover_step_reported`` hook; every report updates its instance's ``last_step`` and ``last_step_ts`` (hang
detection and blame, re-attach) unless it was overtaken by a newer one
(``InstanceTable.note_report``). Nothing is written to SQLite per report:
:meth:`ProgressRecorder.flush_due` writes the instances' last steps and the job's step,
metrics and step times on a timer (``PROGRESS_FLUSH_S``). Workers already coalesce
their reports (``dlrover_core.runtime.reporting``).
A per-report extension (coalescing, sampling, a tuner's metric feed) belongs in
:meth:`ProgressRecorder.on_report`.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

from dlrover_core.master.events import EventLog

if TYPE_CHECKING:
    from dlrover_core.master.scope import JobScope

#: Seconds between writes of the instances' ``last_step`` and the job's step, metrics and
#: step times to the JobContext.
PROGRESS_FLUSH_S = 2.0


class ProgressRecorder:
    def __init__(self, scope: JobScope) -> None:
        self.scope = scope
        self.metrics_log = EventLog(scope.run_paths.metrics)
        self._last_flush = 0.0
        self._job_dirty = False  # rank 0 moved the job's step since the last flush
        self._agents_dirty = False  # an agent not yet persisted reported
        #: the job's ``TuningController`` (set by the JobMaster when tuning is on)
        self.tuning: Any = None
        #: the job's ``StragglerDetector`` (set by the controller)
        self.stragglers: Any = None
        #: report calls by kind: ``report`` (rank 0), ``report_rank_n`` (other ranks,
        #: directly), ``report_batch`` (a node agent's calls), ``batch_entries``
        self.calls: collections.Counter = collections.Counter()

    def on_batch(self, entries: list, agent: str | None = None,
                 node_id: str | None = None) -> None:
        """Reports of several ranks (``(role, rank, step, metrics, ts)`` each), applied
        one by one as :meth:`on_report` applies a single report. ``agent``/``node_id``:
        the Ray actor name of the agent that sent them and its node, remembered in
        ``scope.agents`` (persisted by :meth:`flush_due`) for a restarted master."""
        if agent and node_id and self.scope.agents.get(node_id) != agent:
            with self.scope.lock:
                self.scope.agents[node_id] = agent
                self._agents_dirty = True
        self.calls["report_batch"] += 1
        self.calls["batch_entries"] += len(entries)
        for role, rank, step, metrics, ts in entries:
            self.on_report(role, rank, step, metrics, ts)

    def on_report(self, role: str, rank: int, step: int, metrics: dict, ts: float) -> None:
        """A step report of ``role``/``rank``: ``metrics`` name -> float; ``ts`` the
        worker's unix time when the step ended."""
        s = self.scope
        with s.lock:
            s.instances.note_report(role, rank, step, ts)
            if rank == 0:
                s.metrics.update(metrics)
                if step > s.step:
                    s.step = step
                    s.step_times.setdefault(step, ts)
                    self._job_dirty = True
        if rank == 0:
            self.metrics_log.emit("step", role=role, step=step, **metrics)
        if self.tuning is not None:  # the tuner's metric feed (never raises)
            self.tuning.on_report(role, rank, step, metrics)
        if self.stragglers is not None:
            self.stragglers.on_report(role, rank, step, metrics)
        s.pm.step_reported(s.name, role, rank, step, metrics)

    def on_checkpoint_loaded(self, role: str, rank: int, step: int, source: str | None,
                             path: str, attempt: int = 0) -> None:
        """Rank 0 of ``role`` loaded checkpoint ``step`` (``source``: ``memory``,
        ``disk``, ...; ``path``: the step's directory) at its ``attempt``-th start; emits
        ``checkpoint_loaded``. A load at the first start (attempt 0) is where the run
        resumed from (``resumed_from``); later ones are recoveries."""
        if rank != 0:
            return
        s = self.scope
        source = source or "unknown"  # a saver that does not say
        if attempt == 0:
            with s.lock:
                s.resumed_from.setdefault(role, {"step": int(step), "source": source,
                                                 "path": path})
                s.context.set("resumed_from", s.resumed_from)
        s.emit("checkpoint_loaded", role=role, step=int(step), source=source, path=path,
               attempt=attempt)

    def on_checkpoint_saved(self, role: str, rank: int, step: int, seconds: float) -> None:
        """Rank 0 of ``role`` saved ``step``, blocking its loop for ``seconds`` s."""
        if rank != 0:
            return
        s = self.scope
        with s.lock:
            s.checkpoint_steps[role] = step
            s.context.set("checkpoint_steps", s.checkpoint_steps)
        s.emit("checkpoint_saved", role=role, step=step, blocking_s=round(seconds, 4))

    def flush_due(self, force: bool = False) -> int:
        """Persist the instances' ``last_step`` and, when rank 0 moved it, the job's
        step, metrics and step times, once ``PROGRESS_FLUSH_S`` passed (or ``force``);
        returns the rows written."""
        now = time.time()
        if not force and now - self._last_flush < PROGRESS_FLUSH_S:
            return 0
        self._last_flush = now
        s = self.scope
        with s.lock:
            written = s.instances.flush_progress()
            if self._job_dirty:  # the job's step, metrics and step times: 2 writes
                self._job_dirty = False
                s.context.set("progress", {"step": s.step, "metrics": s.metrics})
                s.context.set("step_times", s.step_times)
                written += 2
            if self._agents_dirty:
                self._agents_dirty = False
                s.context.set("agents", s.agents)
                written += 1
        return written

    def close(self) -> None:
        self.metrics_log.close()
