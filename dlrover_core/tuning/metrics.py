"""Per-step metrics of a worker: where the time of a training step goes.

A step (one optimizer step, i.e. ``grad_accum_steps`` micro-batches) is split into

- ``data_wait_s``: time blocked waiting for the next batch (the input pipeline),
- ``compute_s``: forward and backward,
- ``optimizer_s``: the optimizer step and what the backend communicates around it
  (gradient reduction that did not overlap with backward, clipping),
- ``step_s``: wall time from the start of the step to its end (>= the sum above; the
  rest is the training loop's own overhead, reported as ``other_s``),

plus the throughput figures:

- ``samples``: global samples of the step (all ranks),
- ``interval_s``: wall time from the end of the previous step to the end of this one
  (the first step: from its start). It includes everything the loop does between two
  steps (reporting, checkpointing, evaluation) and every data wait, so the
  ``interval_s`` of consecutive steps add up to the run's wall time,
- ``samples_per_s``: samples over the wall time of the last ``rate_window`` steps
  (``sum(samples) / sum(interval_s)``): what the progress bar shows.

Throughput is samples over the wall time of a window, data waits included, as MLPerf
Training and DeepSpeed's autotuner measure it; never the median (or mean) of per-step
rates, which over-weights the steps whose batch was already waiting when a loader
delivers in bursts. Windows of steps are summarised the same way by
:meth:`dlrover_core.tuning.tuner.WindowSummary.from_reports`.

And ``peak_rss_bytes``
(the training process's peak resident set *during this step*: Linux's ``VmHWM``, reset
at each step start by writing ``5`` to ``/proc/self/clear_refs``; where that is not
possible, the process's lifetime peak from ``getrusage``; loader worker processes are
not included), ``cuda_max_allocated_bytes`` (``torch.cuda.max_memory_allocated`` of the
step, its peak statistics reset at step start, when CUDA is in use),
``memory_capacity_bytes`` (what this rank may use: the CUDA device's memory, else the
node's RAM (or cgroup limit) divided by ``local_world_size``) and ``prefetch_depth``
(batches ready in the loader's queue when the step asked for one, from
:class:`~dlrover_core.tuning.dataloader.ElasticDataLoader`), ``prefetch_fill`` (that
depth over the queue's capacity, ``num_workers * prefetch_factor``: 0..1; a loader
that keeps ahead of the step keeps its queue nearly full, one at its capacity finds it
nearly empty whether or not the step waits), and ``loader_refill``
(``1.0``, only on a step that took a batch of a change's transition:
:attr:`ElasticDataLoader.refilling <dlrover_core.tuning.dataloader.ElasticDataLoader.refilling>`),
``minor_faults`` and ``involuntary_switches`` (the training process's minor page faults
and involuntary context switches during the step, every thread included:
``getrusage(RUSAGE_SELF)``'s ``ru_minflt`` and ``ru_nivcsw``; loader worker processes
not included): what explains a step slower than another of the same settings (memory
being faulted in, a core taken by another process).

Units: seconds, bytes, samples/s. ``data_wait_s`` is host time
(``time.perf_counter``). Where CUDA is initialised, the ``compute`` and ``optimizer``
phases are timed with CUDA events on the current stream
(``torch.cuda.Event(enable_timing=True)``, read at ``end_step`` after waiting for the
step's last event): the device's time, not the host's, which only queues the kernels;
``cuda_sync=True`` instead synchronises the device at each phase end and uses the host
clock.

**The collective wait** (``comm_wait_s``): with :func:`measure_comm_wait` on a
``DistributedDataParallel`` model (the ``ddp`` backend's ``wrap`` does it), every
backward's gradient all-reduce is timed per rank: from this rank's arrival with its
last gradient bucket (the end of its own backward) to the completion of its last
all-reduce (CUDA events where the gradients are on a GPU). A rank that others wait for
has a short wait; the ranks waiting for it a long one. :class:`StepTimer` then charges
that wait to ``comm_wait_s`` instead of ``compute_s`` (DDP's backward contains the
all-reduce), and :class:`StepClock` (applied to every step report of a process in which
the hook runs, ``runtime.reporting``) fills in for workloads that time nothing:
``step_s`` (wall time per step between two reports, after a synchronisation of the
current CUDA stream where CUDA is initialised), ``comm_wait_s``, and ``compute_s =
step_s - comm_wait_s - data_wait_s`` (what the rank did on its own).
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from dlrover_core.tuning.comm_wait import (  # noqa: F401 - re-exported (backends, tests)
    COMM_WAIT, CommWaitMeter, _cuda_in_use, measure_comm_wait)

PHASES = ("data", "compute", "optimizer")
_PHASE_KEYS = {"data": "data_wait_s", "compute": "compute_s", "optimizer": "optimizer_s"}

#: The metric names :meth:`StepTimer.end_step` reports (``cuda_max_allocated_bytes``,
#: ``comm_wait_s`` and ``prefetch_depth``/``prefetch_fill`` only when known,
#: ``loader_refill`` only when set).
METRIC_NAMES = ("data_wait_s", "compute_s", "optimizer_s", "comm_wait_s", "other_s", "step_s",
                "samples", "interval_s", "samples_per_s", "peak_rss_bytes",
                "cuda_max_allocated_bytes",
                "memory_capacity_bytes", "prefetch_depth", "prefetch_fill", "loader_refill")


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux ``/proc/self/clear_refs``); returns
    whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes since the last
    :func:`reset_peak_rss` (``VmHWM``), else since the process started (``ru_maxrss``,
    KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def memory_capacity_bytes(local_world_size: int = 1) -> int:
    """Memory one rank may use, in bytes: the current CUDA device's total memory when
    CUDA is initialised, else the node's physical RAM (or the cgroup v2 ``memory.max``
    when lower) divided by ``local_world_size``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw != "max":
            total = min(total, int(raw))
    except (OSError, ValueError):
        pass
    return int(total // max(1, local_world_size))


def cuda_max_allocated_bytes() -> int | None:
    """``torch.cuda.max_memory_allocated()`` when torch is imported and CUDA is
    initialised, else ``None`` (never initialises CUDA itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


class StepClock:
    """Fills in a step report's timing where the workload timed nothing (module doc),
    once :data:`COMM_WAIT` has measured a backward in this process; until then
    :meth:`fill` returns the metrics as they are.

    Args:
        meter: the collective-wait meter (default :data:`COMM_WAIT`).
    """

    def __init__(self, meter: CommWaitMeter | None = None) -> None:
        self.meter = COMM_WAIT if meter is None else meter
        self._mark: tuple[int, float, float] | None = None  # step, perf_counter, wait

    def fill(self, step: int, metrics: dict) -> dict:
        """``metrics`` with ``step_s``, ``comm_wait_s`` and ``compute_s`` added where
        missing (seconds per step: the time since the previous report over the steps
        since it). The first report, one whose step did not advance (a restart, a
        rollback) and every report while the hook has not run get nothing added."""
        active = self.meter.active
        if active and _cuda_in_use():  # the step's kernels end before its time is read
            sys.modules["torch"].cuda.current_stream().synchronize()
        now, waited = time.perf_counter(), self.meter.total()
        mark, self._mark = self._mark, (int(step), now, waited)
        if not active or mark is None or step <= mark[0]:
            return metrics
        n = step - mark[0]
        out = dict(metrics)
        out.setdefault("step_s", (now - mark[1]) / n)
        out.setdefault("comm_wait_s", (waited - mark[2]) / n)
        if "compute_s" not in metrics:
            out["compute_s"] = max(0.0, float(out["step_s"]) - float(out["comm_wait_s"])
                                   - float(metrics.get("data_wait_s", 0.0)))
        return out


class StepTimer:
    """Accumulates phase times within a step and turns them into metrics.

    Usage::

        timer = StepTimer()
        timer.start_step()
        with timer.phase("data"):
            x, y = next(batches)
        with timer.phase("compute"):
            loss = model(x, y); loss.backward()
        with timer.phase("optimizer"):
            opt.step()
        metrics = timer.end_step(samples=global_batch)   # dict of floats for report()

    A phase may be entered several times in a step (once per micro-batch); the times add.
    Where CUDA is initialised, ``compute`` and ``optimizer`` are timed with CUDA events
    (module doc). The collective wait :data:`COMM_WAIT` measured during the step is
    taken out of ``compute_s`` (never below 0) and reported as ``comm_wait_s``.

    Args:
        cuda_sync: call ``torch.cuda.synchronize()`` at each phase end and time every
            phase with the host clock instead of CUDA events.
        local_world_size: ranks on this node (for ``memory_capacity_bytes``).
        rate_window: steps over which ``samples_per_s`` is taken (>= 1).
    """

    def __init__(self, cuda_sync: bool = False, local_world_size: int = 1,
                 rate_window: int = 10) -> None:
        if rate_window < 1:
            raise ValueError(f"rate_window={rate_window!r} is invalid; allowed: an integer >= 1")
        self.cuda_sync = cuda_sync
        self.local_world_size = local_world_size
        self.rate_window = rate_window
        self._last_end: float | None = None  # perf_counter of the previous step's end
        self._recent: collections.deque = collections.deque(maxlen=rate_window)
        self._capacity: int | None = None
        self._t0: float | None = None
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._prefetch: list[int] = []
        self._fill: list[float] = []
        self._refill = False
        self._events: list[tuple[str, object, object]] = []  # phase, CUDA start, end
        self._waited = COMM_WAIT.total()  # the collective wait before this step
        self._rusage: tuple[int, int] | None = None  # minor faults, involuntary switches
        self.last: dict[str, float] = {}

    def start_step(self) -> None:
        """Mark the start of a step (also called implicitly by the first phase)."""
        reset_peak_rss()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._events = []
        self._waited = COMM_WAIT.total()
        self._prefetch, self._fill = [], []
        self._refill = False
        self._rusage = _faults_and_switches()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (``data``, ``compute`` or ``optimizer``).

        Raises:
            ValueError: an unknown phase name.
        """
        if name not in self._acc:
            raise ValueError(f"phase {name!r} is unknown; allowed: {', '.join(PHASES)}")
        if self._t0 is None:
            self.start_step()
        if name != "data" and not self.cuda_sync and _cuda_in_use():
            torch = sys.modules["torch"]
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((name, start, end))
            return
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                _cuda_sync()
            self._acc[name] += time.perf_counter() - t

    def add(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` to phase ``name`` (time measured elsewhere)."""
        if name not in self._acc:
            raise ValueError(f"phase {name!r} is unknown; allowed: {', '.join(PHASES)}")
        if self._t0 is None:
            self.start_step()
        self._acc[name] += float(seconds)

    def drop_step(self) -> None:
        """Forget the current step (it was rolled back and runs again); its time stays
        in the next step's ``interval_s``, so the wall time is still all counted."""
        self._t0 = None
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._events = []
        self._prefetch, self._fill = [], []
        self._refill = False
        self._waited = COMM_WAIT.total()

    def note_pause(self, seconds: float) -> None:
        """The loop was paused from outside for ``seconds`` between two steps (a
        benchmark that runs jobs in alternating slices): that time is taken out of the
        next step's ``interval_s``, so ``samples_per_s`` and the tuner's windows
        measure the job while it ran.

        Raises:
            ValueError: ``seconds`` < 0.
        """
        if seconds < 0:
            raise ValueError(f"note_pause({seconds}): allowed: seconds >= 0")
        if self._last_end is not None:
            self._last_end += float(seconds)

    def note_refill(self, refilling: bool) -> None:
        """Record whether a batch of this step belonged to a loader change's transition
        (reported as ``loader_refill``)."""
        self._refill = self._refill or bool(refilling)

    def note_prefetch_depth(self, depth: int | None, capacity: int | None = None) -> None:
        """Record the loader's ready-batch count seen when a batch was requested and,
        with the queue's ``capacity`` (batches, > 0), its share of it."""
        if depth is not None:
            self._prefetch.append(int(depth))
            if capacity:
                self._fill.append(min(1.0, int(depth) / int(capacity)))

    def end_step(self, samples: int) -> dict[str, float]:
        """Close the step; returns its metrics (see the module docstring).

        Args:
            samples: samples the step consumed over all ranks (the global batch).
                Count tokens instead (``samples * sequence length``) to get tokens/s:
                the unit is whatever is passed here.
        Raises:
            RuntimeError: no step was started.
        """
        if self._t0 is None:
            raise RuntimeError("end_step() without start_step() or a phase")
        if self._events:  # CUDA-timed phases: wait for the step's last kernel
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self._acc[name] += start.elapsed_time(end) / 1000.0  # ms -> s
            self._events = []
        waited, self._waited = self._waited, COMM_WAIT.total()
        comm = max(0.0, self._waited - waited)
        now = time.perf_counter()
        step_s = max(now - self._t0, 1e-9)
        interval_s = max(now - (self._t0 if self._last_end is None else self._last_end), 1e-9)
        self._last_end = now
        self._recent.append((float(samples), interval_s))
        out = {_PHASE_KEYS[p]: self._acc[p] for p in PHASES}
        if COMM_WAIT.active:
            out["comm_wait_s"] = comm
            out["compute_s"] = max(0.0, out["compute_s"] - comm)
        out["step_s"] = step_s
        out["other_s"] = max(0.0, step_s - sum(self._acc.values()))
        out["samples"] = float(samples)
        out["interval_s"] = interval_s
        out["samples_per_s"] = (sum(n for n, _ in self._recent)
                                / sum(dt for _, dt in self._recent))
        out["peak_rss_bytes"] = float(peak_rss_bytes())
        cuda = cuda_max_allocated_bytes()
        if cuda is not None:
            out["cuda_max_allocated_bytes"] = float(cuda)
        if self._capacity is None:
            self._capacity = memory_capacity_bytes(self.local_world_size)
        out["memory_capacity_bytes"] = float(self._capacity)
        if self._prefetch:
            out["prefetch_depth"] = sum(self._prefetch) / len(self._prefetch)
        if self._fill:
            out["prefetch_fill"] = sum(self._fill) / len(self._fill)
        if self._refill:
            out["loader_refill"] = 1.0
        if self._rusage is not None:
            faults, switches = _faults_and_switches()
            out["minor_faults"] = float(faults - self._rusage[0])
            out["involuntary_switches"] = float(switches - self._rusage[1])
        self._t0 = None
        self.last = out
        return out


def _faults_and_switches() -> tuple[int, int]:
    """This process's minor page faults and involuntary context switches so far, every
    thread included (``getrusage(RUSAGE_SELF)``: ``ru_minflt``, ``ru_nivcsw``)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_nivcsw


def _cuda_sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
