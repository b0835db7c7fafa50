"""What a plain ``torchrun`` script run as a script role (``dlrover-run``,
``roles.R.command``) may tell the JobMaster, without a workload class. Every call is
optional: the script runs unchanged under plain ``torchrun``, where they do nothing.

- :func:`report_step` ``(step, samples=None, **metrics)``: the step report a
  workload's ``self.report(step, ...)`` sends, so ``metrics.jsonl``, the progress of
  ``dlrover status``, the job's step and goodput in ``summary.json`` and the step panel
  of ``dlrover timeline`` cover the script role. Non-blocking: rank 0 sends each report
  at once (one fire-and-forget Ray call, no reply waited for); the other ranks coalesce
  (:class:`dlrover_core.runtime.reporting.StepReporter`; their newest report is also sent
  when the process exits, and at least every quarter of ``failover.hang_timeout_s``).
  With ``failover.hang_timeout_s`` > 0 a rank that has reported a step in its
  attempt and then reports none for that long is a hang (restart of the role); a
  rank that never reports is not watched. The first call of a process starts joining
  the job's Ray cluster and looking the JobMaster up in a background thread (0.5 s
  idle, 2.9-3.8 s beside one busy loop on 2 cores, measured: a rank blocked there held its peers in
  their next collective, silent, long enough to look hung); reports made meanwhile
  wait in order and go once it is joined (or when the script ends normally). Until
  then a SIGTERM (the role stopping the script: an elastic re-form, a failover, the
  job's end) first waits up to ``SIGTERM_FLUSH_S`` for them to go, then ends the
  process as Python's default SIGTERM does: the first ``report_step``, in the main
  thread, sets that handler when SIGTERM has Python's default, and the first call
  after the join puts the default back (a Python handler runs only between the main
  thread's bytecodes: one blocked in a collective with a dead peer would wait for
  the SIGKILL). A SIGKILL loses them. Outside dlrover it is a no-op that warns once
  (``RuntimeWarning``) and returns ``False``.
- :func:`report_checkpoint` ``(step, seconds=0.0)``: the script saved a checkpoint of
  ``step`` (what a workload's checkpointer reports): ``checkpoint_saved`` in the
  events and the timeline, and the boundary an elastic role grows at
  (:mod:`dlrover_core.master.elastic`). ``FlashCheckpointer.save`` calls it.
  :func:`report_checkpoint_loaded` ``(step, source, path)``: the script restored
  ``step`` (``checkpoint_loaded``). Both are silent no-ops outside dlrover. Both are
  non-blocking: one background thread sends them in the order made, each acknowledged
  before the next, and the script's end waits for them (at most ``JOIN_AT_EXIT_S``).
  They go after the step reports that wait for the join: a checkpoint may make the
  master end this process (an elastic role grows at it), which would drop step reports
  still waiting.
- :func:`script_master`: the JobMaster and this rank's identity, from the environment a
  script role gives its script (:data:`SCRIPT_ENV`); ``ShardSampler.for_script`` uses it.
- :func:`measure_comm_wait` ``(ddp_model)``: time the gradient all-reduce of the
  script's ``DistributedDataParallel`` model per rank (a DDP communication hook doing
  DDP's own mean all-reduce; :mod:`dlrover_core.tuning.metrics`). Every rank's
  :func:`report_step` then carries ``step_s``, ``comm_wait_s`` (from its arrival with its
  last gradients to the all-reduce's end) and ``compute_s`` (the rest of the step:
  its own work), which the straggler detector compares across ranks
  (docs/node-health.md). Works the same under plain ``torchrun`` (the timing is
  computed, nothing is sent).

Example (``train.py``, runs the same under ``torchrun``)::

    from dlrover_core.script_api import measure_comm_wait, report_step
    model = measure_comm_wait(DistributedDataParallel(model))
    for step in range(steps):
        loss = train_step(batch)
        report_step(step, samples=len(batch), loss=loss.item())
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable

from dlrover_core.script_master import (  # noqa: F401 - re-exported (public API, tests)
    SCRIPT_ENV, NotInDlroverError, ScriptMaster, _int_env, _lock, in_dlrover, script_master)


class _Joiner:
    """Joins the job (:func:`script_master`) in a daemon thread and sends step reports
    once joined: ``__call__(step, metrics, ts)`` is a :class:`StepReporter`'s ``send``;
    reports made before the join ends wait (at most ``max_pending``, the oldest dropped
    first) and go one after the other, each acknowledged before the next (the master's
    ``report`` runs in a thread pool: a burst would reach ``metrics.jsonl`` out of
    order), before any new one; one not acknowledged within ``JOIN_AT_EXIT_S`` is
    logged and the next goes (only a dead master stops them). ``error``: what the join
    raised (reports are then dropped)."""

    def __init__(self, max_pending: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque(maxlen=max_pending)
        self._sm: ScriptMaster | None = None
        self.error: BaseException | None = None
        self.joined = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._join, name="dlrover-script-join", daemon=True).start()

    def _join(self) -> None:
        sm: ScriptMaster | None
        try:
            sm = script_master("report_step")
        except BaseException as e:  # noqa: BLE001 - raised by the next report_step
            sm, self.error = None, e
        ray = sys.modules.get("ray")  # imported by the join
        while sm is not None and ray is not None:  # the waiting reports, each acknowledged
            with self._lock:
                if not self._pending:
                    break
                step, metrics, ts = self._pending.popleft()
            try:
                ray.get(_send(sm, step, metrics, ts), timeout=JOIN_AT_EXIT_S)
            except ray.exceptions.RayActorError:  # the master is gone: the rest go nowhere
                sm = None
            except Exception as exc:  # noqa: BLE001 - one report not acknowledged in time
                # (or refused): it was sent; the next ones still go
                logging.getLogger(__name__).warning(
                    "report_step: the report of step %d was not acknowledged: %s", step,
                    f"{type(exc).__name__}: {str(exc)[:200]}")
        with self._lock:
            self._sm = sm
            self._pending.clear()
            self.joined.set()

    def __call__(self, step: int, metrics: dict, ts: float) -> Any:
        with self._lock:
            if not self.joined.is_set():
                self._pending.append((step, metrics, ts))
                return None
            sm = self._sm
        return None if sm is None else _send(sm, step, metrics, ts)


def _send(sm: ScriptMaster, step: int, metrics: dict, ts: float) -> Any:
    """One step report to the master (its ObjectRef; fire-and-forget unless waited on)."""
    return sm.master.report.remote(sm.role, sm.rank, step, metrics, ts)


class _Steps:
    """This process's step reporter and its join (made at the first :func:`report_step`)."""

    reporter: Any = None
    joiner: _Joiner | None = None
    warned = False
    last_ts: float | None = None


def _close_at_exit() -> None:
    """The script ends: wait (at most ``JOIN_AT_EXIT_S``) for a join still under way and
    send the newest reports. Runs before every ``atexit`` handler, Ray's shutdown among
    them (a Ray call after it ends the process with exit code 1), whenever ray was
    imported: see :func:`_before_atexit`."""
    if _Steps.joiner is not None:
        _Steps.joiner.joined.wait(JOIN_AT_EXIT_S)
    if _Steps.reporter is not None:
        _Steps.reporter.close()


def _before_atexit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter ends, before the ``atexit`` handlers: CPython's
    ``threading._register_atexit`` (3.9+; what ``concurrent.futures`` uses), called
    when the main thread ends, before the interpreter's ``atexit`` phase. Ray registers
    its shutdown with ``atexit`` when it is imported, here by the join's thread, maybe
    after this call or only during the exit; plain ``atexit`` would then run ``fn``
    after that shutdown."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # the interpreter is already shutting down
        pass
    atexit.register(fn)


#: Seconds a script that ends waits for its join to the job, when still under way; also
#: how long the join waits for the master to take each report made meanwhile.
JOIN_AT_EXIT_S = 30.0

#: Seconds a SIGTERM waits for the join to send the reports made before it: under the
#: 5 s a script role gives a stopped script before its SIGKILL (``ScriptHost.stop_script``).
SIGTERM_FLUSH_S = 4.0


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: let the step reports that wait for the join go (at most
    ``SIGTERM_FLUSH_S``), then end the process with SIGTERM under its default action,
    as if this handler were not there (exit status -15)."""
    if _Steps.joiner is not None:
        _Steps.joiner.joined.wait(SIGTERM_FLUSH_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _swap_sigterm(current: Any, new: Any) -> None:
    """Make ``new`` SIGTERM's handler where it is ``current`` now: before the join
    ``SIG_DFL`` -> :func:`_on_sigterm`, after it back. Only in the main thread (only it
    may set handlers); a handler of the script's own (or Ray's, when the script called
    ``ray.init`` itself) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) == current:
            signal.signal(signal.SIGTERM, new)
    except (ValueError, OSError):  # not settable here (an embedded interpreter)
        pass


def report_step(step: int, samples: int | None = None, **metrics: float) -> bool:
    """Report that optimizer ``step`` (an int >= 0) ended, with the ``samples`` this rank
    trained in it (adds metrics ``samples`` and, from the second report on,
    ``samples_per_s``: samples / s since this process's previous report) and scalar
    ``metrics`` (``loss=...``). Rank 0's report moves the job's step and goes to
    ``metrics.jsonl``; every rank's feeds hang detection. Non-blocking (the first
    call starts the join to the job in the background; see the module docstring).
    Returns ``True`` when the report was sent to the JobMaster or waits for the join,
    ``False`` outside dlrover (a ``RuntimeWarning`` the first time).

    Raises:
        ValueError: ``step`` or ``samples`` is negative or not an integer, or ``$RANK``
            or ``$WORLD_SIZE`` is not an integer.
        TypeError: a metric is not a number.
        NotInDlroverError: the environment is a script role's but its JobMaster is gone
            (raised by the first call after the background join found that).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"report_step(step={step!r}): allowed: an integer >= 0")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)
                                or samples < 0):
        raise ValueError(f"report_step(samples={samples!r}): allowed: None or an integer >= 0")
    clean: dict[str, float] = {}
    for k, v in metrics.items():
        try:
            clean[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"report_step({k}={v!r}): metrics must be numbers") from None
    if not in_dlrover():
        if not _Steps.warned:
            _Steps.warned = True
            missing = ", ".join(k for k in SCRIPT_ENV if not os.environ.get(k))
            warnings.warn(f"dlrover_core.script_api.report_step: not in a dlrover script role "
                          f"({missing} not set); step reports are dropped", RuntimeWarning,
                          stacklevel=2)
        return False
    now = time.time()
    if samples is not None:
        clean["samples"] = float(samples)
        if _Steps.last_ts is not None and now > _Steps.last_ts:
            clean["samples_per_s"] = samples / (now - _Steps.last_ts)
    _Steps.last_ts = now
    if _Steps.joiner is not None and _Steps.joiner.error is not None:
        raise _Steps.joiner.error
    if _Steps.reporter is None:
        from dlrover_core.runtime.reporting import StepReporter, report_interval_s

        rank, world_size = _int_env("RANK", None), _int_env("WORLD_SIZE", 1)
        hang_s = float(os.environ.get("DLROVER_HANG_TIMEOUT_S") or 0.0)
        joiner = _Joiner()
        _Steps.reporter = StepReporter(joiner, rank,
                                       report_interval_s(max(1, world_size), hang_s))
        _Steps.joiner = joiner
        joiner.start()
        _before_atexit(_close_at_exit)  # the newest reports still go when it ends
        _swap_sigterm(signal.SIG_DFL, _on_sigterm)  # and when the role stops it meanwhile
    elif _Steps.joiner is not None and _Steps.joiner.joined.is_set():
        _swap_sigterm(_on_sigterm, signal.SIG_DFL)
    _Steps.reporter.report(step, clean, now)
    return True


def measure_comm_wait(ddp_model: Any) -> Any:
    """Time the gradient all-reduce of ``ddp_model`` (a
    ``torch.nn.parallel.DistributedDataParallel``) per rank, so that every
    :func:`report_step` of this process carries ``step_s``, ``comm_wait_s`` and
    ``compute_s`` (seconds per step; module doc). Returns the model.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        RuntimeError: the model already has a communication hook (DDP's error).
    """
    from dlrover_core.tuning.metrics import measure_comm_wait as measure

    return measure(ddp_model)


def report_checkpoint(step: int, seconds: float = 0.0) -> bool:
    """The script saved a checkpoint of ``step``; its loop was blocked ``seconds`` s
    (only rank 0's report counts, as for workloads). Non-blocking: the report goes in
    order with the other checkpoint reports of this process (:class:`_CheckpointReports`).
    Returns ``False`` (silently: plain ``torchrun``) outside dlrover, else ``True``.

    Raises:
        ValueError: ``step`` is negative or not an integer.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"report_checkpoint(step={step!r}): allowed: an integer >= 0")
    if not in_dlrover():
        return False
    seconds = float(seconds)
    _CheckpointReports.put(lambda sm: sm.master.checkpoint_saved.remote(
        sm.role, sm.rank, step, seconds))
    return True


def report_checkpoint_loaded(step: int, source: str | None, path: str = "") -> bool:
    """The script restored the checkpoint of ``step`` from ``source`` (``memory``,
    ``disk``, ...; ``path``: the step's directory). Non-blocking and in order, as
    :func:`report_checkpoint`; returns ``False`` outside dlrover."""
    if not in_dlrover():
        return False
    step = int(step)
    _CheckpointReports.put(lambda sm: sm.master.checkpoint_loaded.remote(
        sm.role, sm.rank, step, source, path, sm.attempt))
    return True


class _CheckpointReports:
    """This process's checkpoint reports, sent by one daemon thread in the order made,
    each acknowledged by the master before the next: the master runs them in a thread
    pool, where two sent at once may run out of order (the summary's
    ``checkpoint_steps`` would go back). The thread first waits for the join
    (:func:`_master_or_none`), so they go after the step reports waiting for it. When
    the script ends, :meth:`flush` waits (at most ``JOIN_AT_EXIT_S``) for those not yet
    acknowledged: a save a few ms before the end was lost with a fire-and-forget call.
    A report not acknowledged within ``JOIN_AT_EXIT_S`` is logged and the next goes;
    with no master (gone, or never found) the rest are dropped."""

    queue: Any = None
    lock = threading.Lock()

    @classmethod
    def put(cls, send: Callable[[ScriptMaster], Any]) -> None:
        with cls.lock:
            if cls.queue is None:
                import queue

                cls.queue = queue.Queue()
                threading.Thread(target=cls._run, args=(cls.queue,), daemon=True,
                                 name="dlrover-checkpoint-reports").start()
                _before_atexit(cls.flush)
            cls.queue.put(send)

    @staticmethod
    def _run(todo: Any) -> None:
        sm, found = None, False
        while True:
            send = todo.get()
            try:
                if not found:
                    sm, found = _master_or_none(), True
                if sm is not None:
                    ray = sys.modules["ray"]
                    try:
                        ray.get(send(sm), timeout=JOIN_AT_EXIT_S)
                    except ray.exceptions.RayActorError:  # the master is gone
                        sm = None
            except Exception as exc:  # noqa: BLE001 - this one not acknowledged in time
                logging.getLogger(__name__).warning(
                    "a checkpoint report was not acknowledged: %s",
                    f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                todo.task_done()

    @classmethod
    def flush(cls, timeout_s: float = JOIN_AT_EXIT_S) -> bool:
        """Wait until every report made so far is acknowledged (or dropped), at most
        ``timeout_s`` s; ``True`` when none is left."""
        todo = cls.queue
        deadline = time.monotonic() + timeout_s
        while todo is not None and todo.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return todo is None or not todo.unfinished_tasks


def _master_or_none() -> ScriptMaster | None:
    """The job's master for a checkpoint report, once the step reports made before the
    join are sent (``None`` outside dlrover or without a JobMaster)."""
    if not in_dlrover():
        return None
    try:
        sm = script_master()
    except NotInDlroverError:
        return None
    if _Steps.joiner is not None:
        _Steps.joiner.joined.wait(JOIN_AT_EXIT_S)
    return sm
