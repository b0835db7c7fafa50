"""TensorBoard scalars of a job, written by the JobMaster (``observability.tensorboard``).

Every record the master appends to ``metrics.jsonl`` and ``events.jsonl`` goes through
:meth:`TensorBoardSink.on_record`, which turns it into scalars (TensorBoard event
files, written with ``torch.utils.tensorboard.SummaryWriter``; needs torch and the
``tensorboard`` package, the optional extra ``dlrover-core[tensorboard]``):

========================  ===========================================  ==========
tag                       from                                         step
========================  ===========================================  ==========
``<role>/<metric>``       each ``step`` record (every numeric metric)   its step
``job/restarts``          ``failure_classified`` (count so far)        last step
``job/recovery_s``        ``recovery_finished.seconds`` (s)            last step
``job/steps_lost``        ``recovery_finished.steps_lost``             last step
``job/checkpoint_s``      ``checkpoint_saved.blocking_s`` (s)          its step
``job/tuning_version``    ``tuning_applied.version``                   its step
``job/goodput``           ``job_finished`` / summary ``goodput``       last step
``job/wall_s``            ``job_finished.wall_s`` (s)                  last step
========================  ===========================================  ==========

Wall times are the records' ``ts``, so TensorBoard's "relative" axis is job time.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

#: tags of the job-level scalars (see the module docstring)
JOB_TAGS = ("job/restarts", "job/recovery_s", "job/steps_lost", "job/checkpoint_s",
            "job/tuning_version", "job/goodput", "job/wall_s")


def tensorboard_dir(setting: Any, job_dir: str, job: str) -> str | None:
    """Where a job's event files go: ``setting`` ``true`` -> ``<job_dir>/tensorboard``;
    a path -> ``<path>/<job>`` (relative paths from ``job_dir``'s parent); false or
    empty -> ``None`` (off).

    Raises:
        ValueError: ``setting`` is neither a bool nor a non-empty string.
    """
    if setting is None or setting is False:
        return None
    if setting is True:
        return os.path.join(job_dir, "tensorboard")
    if isinstance(setting, str) and setting.strip():
        base = setting if os.path.isabs(setting) else os.path.join(
            os.path.dirname(os.path.abspath(job_dir)), setting)
        return os.path.join(base, job)
    raise ValueError(f"observability.tensorboard: {setting!r} is invalid; allowed: true, "
                     "false or a directory")


class TensorBoardSink:
    """Writes scalars for the records of one job into ``logdir``.

    Raises:
        RuntimeError: torch or the ``tensorboard`` package is not installed (names the
            extra).
    """

    def __init__(self, logdir: str, job_dir: str | None = None,
                 flush_secs: float = 5.0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("observability.tensorboard needs torch and the tensorboard "
                               f"package (pip install 'dlrover-core[tensorboard]'): {exc}"
                               ) from exc
        os.makedirs(logdir, exist_ok=True)
        self.logdir, self.job_dir = logdir, job_dir
        self._writer = SummaryWriter(log_dir=logdir, flush_secs=int(max(1, flush_secs)))
        self._lock = threading.Lock()
        self.last_step = 0
        self.restarts = 0

    def scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        """One scalar ``tag`` = ``value`` at ``step`` (int) and ``wall_time`` (unix s)."""
        with self._lock:
            self._writer.add_scalar(tag, float(value), global_step=int(step),
                                    walltime=wall_time)

    def on_record(self, rec: dict) -> None:
        """Turn one ``metrics.jsonl``/``events.jsonl`` record into scalars."""
        ev, ts = rec.get("event"), float(rec.get("ts", 0.0))
        if ev == "step":
            step = int(rec.get("step", 0))
            self.last_step = max(self.last_step, step)
            role = rec.get("role", "job")
            for key, value in rec.items():
                if key in ("ts", "event", "role", "step", "rank"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self.scalar(f"{role}/{key}", value, step, ts)
        elif ev == "failure_classified":
            self.restarts += 1
            self.scalar("job/restarts", self.restarts, self.last_step, ts)
        elif ev == "recovery_finished":
            self.scalar("job/recovery_s", float(rec.get("seconds", 0.0)), self.last_step, ts)
            if rec.get("steps_lost") is not None:
                self.scalar("job/steps_lost", float(rec["steps_lost"]), self.last_step, ts)
        elif ev == "checkpoint_saved":
            self.scalar("job/checkpoint_s", float(rec.get("blocking_s", 0.0)),
                        int(rec.get("step", self.last_step)), ts)
        elif ev == "tuning_applied":
            self.scalar("job/tuning_version", float(rec.get("version", 0)),
                        int(rec.get("step", self.last_step)), ts)
        elif ev == "job_finished":
            goodput = rec.get("goodput", self._summary_goodput())
            if goodput is not None:
                self.scalar("job/goodput", float(goodput), self.last_step, ts)
            if rec.get("wall_s") is not None:
                self.scalar("job/wall_s", float(rec["wall_s"]), self.last_step, ts)
            self.flush()

    def _summary_goodput(self) -> float | None:
        """``goodput`` of the run's ``summary.json`` (written before ``job_finished``)."""
        if not self.job_dir:
            return None
        import json

        from dlrover_core.runs import run_paths

        try:
            with open(run_paths(self.job_dir).summary) as f:
                return json.load(f).get("goodput")
        except (OSError, ValueError):
            return None

    def flush(self) -> None:
        with self._lock:
            self._writer.flush()

    def close(self) -> None:
        with self._lock:
            self._writer.close()


def attach_tensorboard(spec: Any, job_dir: str, events: Any,
                       metrics: Any) -> TensorBoardSink | None:
    """Start the TensorBoard writer of a job when ``observability.tensorboard`` is on,
    listening to its ``events`` and ``metrics`` logs (``EventLog``s). Called by the
    JobMaster's controller (master process); returns the sink or ``None``. A writer that
    cannot start is reported as a ``tensorboard_unavailable`` event, never an error of
    the job."""
    from omegaconf import OmegaConf

    setting = OmegaConf.select(spec, "observability.tensorboard", default=False)
    try:
        logdir = tensorboard_dir(setting, job_dir, str(spec.name))
        if logdir is None:
            return None
        sink = TensorBoardSink(logdir, job_dir=job_dir)
    except (RuntimeError, ValueError, OSError) as exc:
        events.emit("tensorboard_unavailable", error=str(exc))
        return None
    events.add_listener(sink.on_record)
    metrics.add_listener(sink.on_record)
    events.emit("tensorboard_started", logdir=logdir)
    return sink
