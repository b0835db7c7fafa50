"""The core's tuners, registered through ``dlrover_tuners`` like any plugin's.

- ``dataloader_workers``: while the data wait is more than ``data_wait_share`` of the
  wall time, or the loader's queue is less than ``min_prefetch_fill`` full when a batch
  is requested (``prefetch_fill``: the loader delivers just in time, at its capacity,
  so a faster step would wait, though this one hardly does), raise
  ``dataloader.num_workers`` to what the measured wait implies plus
  ``headroom`` (:meth:`DataloaderWorkersTuner.workers_needed`), up to
  ``max_num_workers``. A reverted raise lowers the ceiling to one below it; a second
  reverted raise from the same count ends the search there.
- ``micro_batch``: double ``dataloader.batch_size`` and halve
  ``optimizer.grad_accum_steps`` (the global batch stays) while throughput rises by at
  least ``min_gain`` per doubling and the predicted memory peak stays below the
  capacity minus ``memory_headroom``; up to ``max_micro_batch``. A doubling that
  gained less than ``min_gain`` ends the growth only if the step was not input-bound
  (data wait at most ``input_bound_share`` of it): an input-bound step hides the gain.
  With ``jump_after_flat`` (the default), a reverted doubling whose window rates were
  neither shown faster nor shown slower than the ones before it (one-sided Welch's
  t-tests at ``FLAT_CONFIDENCE``) is followed by one jump of two doublings
  (micro-batch x4, accumulation / 4) before the search ends, as a line search widens
  a step whose effect it cannot see: a doubling that gains a few percent, under what
  the guard's windows can show, may gain about twice that over two. With
  ``max_data_wait_share`` below 1 it waits while the data wait is more than that share
  of the step (off by default: fewer, larger batches also cut the loader's per-batch
  costs, and the guard reverts a doubling that does not pay). With
  ``keep_global_batch: false`` it may also double the global batch (the learning rate
  then follows ``tuning.lr_scaling``). A micro-batch that ran out of memory is its
  ceiling: it proposes nothing at or above it again.
- ``global_batch`` (opt-in: not among the default ``tuning.tuners``): double the global
  batch by doubling ``optimizer.grad_accum_steps`` (the micro-batch stays, so memory
  does not grow), up to ``max_global_batch`` samples per optimizer step over all
  ranks; fewer optimizer steps and gradient reductions per sample. The controller sets
  the new learning rate by ``tuning.lr_scaling`` (linear: Goyal et al. 2017; sqrt:
  Krizhevsky 2014, Hoffer et al. 2017; see :mod:`dlrover_core.tuning.lr_scaling`). A
  doubling the guard reverts ends the search. It changes the optimisation, not only
  the speed: enable it only where the training recipe allows a larger batch.
"""

from __future__ import annotations

import math
from typing import Any

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.guard import welch_greater
from dlrover_core.tuning.tuner import TunerBase, WindowSummary


def _check_range(options: dict, key: str, low: float, high: float | None = None) -> None:
    if key not in options:
        return
    v = options[key]
    if v < low or (high is not None and v > high):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{key}: {v!r} is invalid; allowed: a number {allowed}")


class DataloaderWorkersTuner(TunerBase):
    defaults = {"max_num_workers": 8, "data_wait_share": 0.1, "headroom": 0.5,
                "min_prefetch_fill": 0.5}

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.ceiling = int(self.options["max_num_workers"])
        self._raised_from: int | None = None  # num_workers before the last proposal
        self._reverted_from: int | None = None  # the count the last reverted raise left

    @classmethod
    def validate_options(cls, options: dict) -> None:
        super().validate_options(options)
        _check_range(options, "max_num_workers", 0, 256)
        _check_range(options, "data_wait_share", 0.0, 1.0)
        _check_range(options, "headroom", 0.0, 10.0)
        _check_range(options, "min_prefetch_fill", 0.0, 1.0)

    def workers_needed(self, window: WindowSummary, num_workers: int) -> int:
        """Loader workers that deliver what the rest of the step consumes, with
        ``headroom``: with ``n >= 1`` workers and a data-wait share ``w`` of the wall
        time, the loader delivers a step's batches in the whole step time ``T`` while
        the rest of the step takes ``(1 - w) T``, so ``n / (1 - w)`` workers keep up;
        loading in the main process (``n = 0``), the reads ``w T`` overlap a compute of
        ``(1 - w) T`` with ``w / (1 - w)`` workers. Times ``1 + headroom``, rounded up:
        a loader that only just keeps up stalls whenever its workers' batches arrive
        together, and a later larger micro-batch computes faster. At least
        ``num_workers + 1``."""
        w = min(window.data_wait_share, 0.95)
        need = (num_workers if num_workers > 0 else w) / (1.0 - w)
        return max(num_workers + 1, math.ceil(need * (1.0 + self.options["headroom"])))

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        nw = current.dataloader.num_workers
        waits = window.data_wait_share > self.options["data_wait_share"]
        # prefetch_fill < 0: not reported (no worker processes, or another loader)
        drained = 0.0 <= window.prefetch_fill < self.options["min_prefetch_fill"]
        if not (waits or drained) or nw >= self.ceiling:
            return None
        self._raised_from = nw
        return {"dataloader": {"num_workers": min(self.ceiling,
                                                  self.workers_needed(window, nw))}}

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        n = int(change["dataloader"]["num_workers"])
        if not accepted:  # the raise did not pay (unless the guard retries it): the
            # ceiling goes below it, and a second revert from the same count ends the
            # search there: every trial costs a switch, and a step between two counts
            # rarely shows at confidence
            kept = self._raised_from
            if kept is None or kept >= n:
                self.ceiling = min(self.ceiling, n - 1)
            else:
                again = self._reverted_from == kept
                self.ceiling = min(self.ceiling, kept if again else n - 1)
                self._reverted_from = kept
        elif n > self.ceiling:  # a retry of a reverted raise paid this time: search on
            self.ceiling = int(self.options["max_num_workers"])

    def state_dict(self) -> dict:
        return {"ceiling": self.ceiling, "reverted_from": self._reverted_from}

    def load_state_dict(self, state: dict) -> None:
        self.ceiling = int(state.get("ceiling", self.ceiling))
        self._reverted_from = state.get("reverted_from", self._reverted_from)


#: confidence at which a reverted doubling must be shown faster or slower for the
#: micro-batch search to end without a jump (``jump_after_flat``)
FLAT_CONFIDENCE = 0.9


def _flat(before: WindowSummary, after: WindowSummary | None) -> bool:
    """Were ``after``'s window rates neither shown faster nor shown slower than
    ``before``'s (two one-sided Welch's t-tests at :data:`FLAT_CONFIDENCE`)? ``False``
    when either has fewer than 2 windows or ``after`` is ``None`` (never ran)."""
    if after is None or min(len(before.window_rates), len(after.window_rates)) < 2:
        return False
    a, b = list(after.window_rates), list(before.window_rates)
    level = 1.0 - FLAT_CONFIDENCE
    return welch_greater(a, b).p > level and welch_greater(b, a).p > level


class MicroBatchTuner(TunerBase):
    defaults = {"max_micro_batch": 256, "memory_headroom": 0.1, "min_gain": 0.02,
                "max_data_wait_share": 1.0, "input_bound_share": 0.3,
                "keep_global_batch": True, "jump_after_flat": True}

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.done = False
        self.jump = False  # the next proposal is two doublings (after a flat revert)
        self.jumped = False  # the one jump was proposed
        self.seen: dict[int, float] = {}  # micro-batch -> memory peak (bytes)
        self.ceiling: int | None = None  # the smallest micro-batch that ran out of memory

    @classmethod
    def validate_options(cls, options: dict) -> None:
        super().validate_options(options)
        _check_range(options, "max_micro_batch", 1)
        _check_range(options, "memory_headroom", 0.0, 0.9)
        _check_range(options, "min_gain", 0.0, 1.0)
        _check_range(options, "max_data_wait_share", 0.0, 1.0)
        _check_range(options, "input_bound_share", 0.0, 1.0)

    def predicted_memory(self, micro_batch: int) -> float:
        """Memory peak expected at ``micro_batch`` (bytes): a line through the two
        largest micro-batches measured, else (one point) a peak in proportion to the
        micro-batch (conservative: most of a CPU process's RSS does not grow)."""
        pts = sorted(self.seen.items())
        if not pts:
            return 0.0
        if len(pts) >= 2:
            (m1, p1), (m2, p2) = pts[-2], pts[-1]
            slope = max(0.0, (p2 - p1) / (m2 - m1))
            return p2 + slope * (micro_batch - m2)
        m, p = pts[-1]
        return p * micro_batch / m

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        if self.done or window.data_wait_share > self.options["max_data_wait_share"]:
            return None
        mb, accum = current.dataloader.batch_size, current.optimizer.grad_accum_steps
        factor = 4 if self.jump else 2
        new_mb = mb * factor
        keep = self.options["keep_global_batch"]
        limit = window.memory_capacity_bytes * (1.0 - self.options["memory_headroom"])
        self.seen[mb] = window.memory_bytes
        if new_mb > self.options["max_micro_batch"] or \
                (self.ceiling is not None and new_mb >= self.ceiling) or \
                (keep and accum % factor) or \
                (limit and self.predicted_memory(new_mb) > limit):
            if self.jump:  # no room for the jump: the search ends
                self.jump, self.done = False, True
            return None
        change: dict[str, Any] = {"dataloader": {"batch_size": new_mb}}
        if keep:
            change["optimizer"] = {"grad_accum_steps": accum // factor}
        if self.jump:  # the one jump: the search ends with it unless it is kept
            self.jump, self.jumped, self.done = False, True, True
        return change

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        if not accepted:
            if after is not None:
                self.seen[int(change["dataloader"]["batch_size"])] = after.memory_bytes
            # one jump of two doublings after a doubling the windows could not tell
            # from the micro-batch before it (see the module docstring)
            self.jump = bool(self.options["jump_after_flat"]) and not self.jumped and \
                _flat(before, after)
            self.done = not self.jump
            return
        self.done = False  # kept (a retry of a reverted doubling too): grow on
        if after is not None:
            self.seen[int(change["dataloader"]["batch_size"])] = after.memory_bytes
            gain = after.samples_per_s / max(before.samples_per_s, 1e-9) - 1.0
            input_bound = after.data_wait_share > self.options["input_bound_share"]
            if gain < self.options["min_gain"] and not input_bound:
                self.done = True  # kept (not worse) but no longer paying: stop growing

    def out_of_memory(self, failed: TuningConfig) -> None:
        self.ceiling = failed.dataloader.batch_size if self.ceiling is None else \
            min(self.ceiling, failed.dataloader.batch_size)
        self.done = True

    def state_dict(self) -> dict:
        return {"done": self.done, "seen": {str(k): v for k, v in self.seen.items()},
                "ceiling": self.ceiling, "jump": self.jump, "jumped": self.jumped}

    def load_state_dict(self, state: dict) -> None:
        self.done = bool(state.get("done", False))
        self.jump = bool(state.get("jump", False))
        self.jumped = bool(state.get("jumped", False))
        self.seen = {int(k): float(v) for k, v in (state.get("seen") or {}).items()}
        self.ceiling = state.get("ceiling")


class GlobalBatchTuner(TunerBase):
    defaults = {"max_global_batch": 1024}

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.done = False

    @classmethod
    def validate_options(cls, options: dict) -> None:
        super().validate_options(options)
        _check_range(options, "max_global_batch", 1)

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        accum = current.optimizer.grad_accum_steps
        if self.done or current.global_batch(window.world_size) * 2 > \
                self.options["max_global_batch"]:
            return None
        return {"optimizer": {"grad_accum_steps": accum * 2}}

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        self.done = self.done or not accepted

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = bool(state.get("done", False))
