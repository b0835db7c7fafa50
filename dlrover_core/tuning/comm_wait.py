"""The collective wait of a DDP rank (:class:`CommWaitMeter`, :data:`COMM_WAIT`): a DDP
communication hook that runs DDP's mean all-reduce and times, per backward, the span
from the rank's last gradient bucket to the end of its last all-reduce (CUDA events on
a GPU, the host clock on a CPU). :mod:`dlrover_core.tuning.metrics` keeps this wait out
of ``compute_s`` and reports it as ``comm_wait_s``."""

from __future__ import annotations

import sys
import threading
import time

from dlrover_core.runtime import attempt_stop


def _cuda_in_use() -> bool:
    """torch is imported and CUDA initialised (never initialises CUDA itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


class CommWaitMeter:
    """The time this process's ranks wait in DDP's gradient all-reduce (module doc).

    One backward's wait is from the call of the hook for its last bucket
    (``GradBucket.is_last()``: this rank's backward is done) to the completion of the
    latest of its all-reduces (on a GPU: CUDA events, the first recorded on the
    backward's stream at the last bucket, the others in the all-reduce futures'
    callbacks, whose streams wait for the collective). :meth:`total` is the sum over
    the backward passes measured so far, seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0
        self._cuda_pending: list[tuple[object, list]] = []
        self._iteration: dict | None = None
        #: backward passes measured so far (``0``: the hook never ran here)
        self.count = 0

    @property
    def active(self) -> bool:
        """Whether the hook has measured a backward in this process."""
        return self.count > 0

    def hook(self, process_group, bucket):  # noqa: ANN001,ANN201 - DDP checks annotations
        """A DDP communication hook (``process_group``, ``bucket``: a ``GradBucket``;
        returns a ``Future`` of the reduced bucket): DDP's own all-reduce (the mean over
        the group, ``ddp_comm_hooks.default_hooks.allreduce_hook``), timed. Register it
        with :func:`measure_comm_wait`.

        Raises:
            AttemptAborted: the master stopped this rank's attempt (a peer failed:
                :func:`dlrover_core.runtime.attempt_stop.stop`); the backward ends here
                instead of computing on to the failed all-reduce.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        attempt_stop.check("a gradient bucket of the backward pass")
        now = time.perf_counter()
        cuda = bucket.buffer().is_cuda
        with self._lock:
            it = self._iteration
            if it is None:
                it = self._iteration = {"outstanding": 0, "last": None, "done": 0.0,
                                        "start_event": None, "end_events": []}
            it["outstanding"] += 1
            if bucket.is_last():
                it["last"] = now
                self._iteration = None  # the next bucket belongs to the next backward
                if cuda:
                    import torch

                    it["start_event"] = torch.cuda.Event(enable_timing=True)
                    it["start_event"].record()

        def done(fut: object) -> object:
            try:
                return fut.value()
            finally:
                end = None
                if cuda:
                    import torch

                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                self._finished(it, time.perf_counter(), end)

        return allreduce_hook(process_group, bucket).then(done)

    def _finished(self, it: dict, now: float, end_event: object) -> None:
        with self._lock:
            it["outstanding"] -= 1
            it["done"] = max(it["done"], now)
            if end_event is not None:
                it["end_events"].append(end_event)
            if it["outstanding"] > 0 or it["last"] is None:
                return
            self.count += 1
            if it["start_event"] is not None:
                self._cuda_pending.append((it["start_event"], it["end_events"]))
            else:
                self._total += max(0.0, it["done"] - it["last"])

    def total(self) -> float:
        """Seconds waited so far (the waits of CUDA backward passes whose events have
        completed; a CUDA wait not yet complete counts at a later call)."""
        with self._lock:
            left = []
            for start, ends in self._cuda_pending:
                if all(e.query() for e in ends) and start.query():
                    self._total += max(0.0, max(start.elapsed_time(e) for e in ends) / 1000)
                else:
                    left.append((start, ends))
            self._cuda_pending = left
            return self._total


#: This process's meter (every DDP model of the process adds to it).
COMM_WAIT = CommWaitMeter()


def measure_comm_wait(ddp_model: object) -> object:
    """Register :data:`COMM_WAIT`'s hook on a ``torch.nn.parallel.DistributedDataParallel``
    model (over the model's own process group); returns the model. DDP takes one
    communication hook per model: a model with a hook of its own cannot have this one.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        RuntimeError: the model already has a communication hook (DDP's error).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"measure_comm_wait({type(ddp_model).__name__}): allowed: a "
                        "torch.nn.parallel.DistributedDataParallel model")
    ddp_model.register_comm_hook(ddp_model.process_group, COMM_WAIT.hook)
    return ddp_model
