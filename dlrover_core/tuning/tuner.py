"""The tuner plugin interface: ``TunerBase`` and the window summary it reads.

A tuner is registered through the ``dlrover_tuners`` hook as a
:class:`~dlrover_core.plugins.records.Tuner` record naming a ``TunerBase`` subclass by
import path. The JobMaster constructs one instance per job (``cls(options)`` with the
job's ``tuning.options.<name>``) and, once a configuration is measured, calls
:meth:`TunerBase.propose` with a :class:`WindowSummary` of the steps measured under
the current :class:`~dlrover_core.tuning.config.TuningConfig` (``tuning.guard.windows``
windows merged: throughput is samples over wall time). After the proposal was tried,
:meth:`TunerBase.feedback` says whether the guard kept or reverted it, and
:meth:`TunerBase.out_of_memory` that a rank ran out of memory under it.

Tuner modules run in the client (option validation) and the master: they must import
nothing heavy (torch, megatron).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from dlrover_core.tuning.config import TuningConfig


#: the per-rank phase metrics a summary keeps (``WindowSummary.ranks``)
_PHASE_KEYS = ("data_wait_s", "compute_s", "optimizer_s", "comm_wait_s")


@dataclass(frozen=True)
class WindowSummary:
    """What the ranks reported over the measurement windows of one config version.

    Throughput is samples over wall time (see :mod:`dlrover_core.tuning.metrics`):
    ``samples_per_s = samples / elapsed_s``, where ``elapsed_s`` is the sum of rank 0's
    ``interval_s`` over the steps (end of the previous step to the end of this one,
    data waits and everything between steps included).

    Attributes:
        version: the ``TuningConfig`` version the windows ran under.
        steps: steps measured; ``first_step``/``last_step``: their range.
        samples_per_s: ``samples / elapsed_s`` (global samples, or whatever unit the
            workload passes to ``StepTimer.end_step``, per second).
        step_s: ``elapsed_s / steps``: mean wall time per step, seconds.
        data_wait_s, compute_s, optimizer_s, comm_wait_s: per step, seconds: the
            largest over the ranks of each rank's mean phase (``ranks``); rank 0's alone
            when no other rank's phases were given. A loader that stalls on one rank
            shows as that rank's data wait, not as the others' compute.
        data_wait_share: the largest rank's ``data_wait_s`` over ``step_s`` (0..1).
        memory_bytes: the largest per-step memory peak of any rank (CUDA
            ``max_memory_allocated`` where reported, else peak RSS), bytes.
        memory_capacity_bytes: the smallest capacity any rank reported, bytes (0: unknown).
        prefetch_depth: mean ready batches in rank 0's loader queue (-1: not reported).
        world_size: data-parallel ranks of the tuned role.
        samples: global samples of the measured steps.
        elapsed_s: their wall time, seconds.
        window_rates: ``samples / elapsed_s`` of each window on its own (what the guard
            tests; one entry for a single window).
        prefetch_fill: mean share of rank 0's loader queue that was ready (0..1:
            ``prefetch_depth`` over ``num_workers * prefetch_factor``; -1: not reported).
        ranks: rank (a string) -> ``{"data_wait_s", "compute_s", "optimizer_s",
            "comm_wait_s", "reports"}``: that rank's mean phases per step over its
            reports (the non-zero ranks' reports are coalesced, so a sample of their
            steps), seconds.
    """

    version: int
    steps: int
    first_step: int
    last_step: int
    samples_per_s: float
    step_s: float
    data_wait_s: float
    compute_s: float
    optimizer_s: float
    data_wait_share: float
    memory_bytes: float
    memory_capacity_bytes: float
    prefetch_depth: float
    world_size: int
    samples: float = 0.0
    elapsed_s: float = 0.0
    window_rates: tuple = ()
    prefetch_fill: float = -1.0
    comm_wait_s: float = 0.0
    ranks: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        out["window_rates"] = [round(r, 6) for r in self.window_rates]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> WindowSummary:
        """The inverse of :meth:`as_dict` (a persisted summary)."""
        return cls(**{**data, "window_rates": tuple(data.get("window_rates") or ())})

    @classmethod
    def from_reports(cls, version: int, rank0: list[tuple[int, dict]],
                     memory_by_rank: dict[int, float], capacity_by_rank: dict[int, float],
                     world_size: int,
                     phases_by_rank: dict[int, list[dict]] | None = None) -> WindowSummary:
        """Summarise rank 0's ``(step, metrics)`` reports of one window (each with the
        ``samples`` and ``interval_s`` of :meth:`StepTimer.end_step
        <dlrover_core.tuning.metrics.StepTimer.end_step>`), every rank's memory peaks
        and ``phases_by_rank`` (rank -> the metrics of its reports in the window; rank
        0's own reports when it is missing there).

        Raises:
            ValueError: ``rank0`` is empty, or a report lacks ``samples`` or ``interval_s``.
        """
        if not rank0:
            raise ValueError("a window needs at least one step report")
        for step, m in rank0:
            if "samples" not in m or "interval_s" not in m:
                raise ValueError(f"the report of step {step} has no 'samples' or "
                                 "'interval_s'; allowed: reports made with "
                                 "StepTimer.end_step() (or TuningSession.end_step())")
        n = len(rank0)
        samples = float(sum(m["samples"] for _, m in rank0))
        elapsed = float(sum(m["interval_s"] for _, m in rank0))

        def total(key: str) -> float:
            return float(sum(m.get(key, 0.0) for _, m in rank0))

        depth = [m["prefetch_depth"] for _, m in rank0 if "prefetch_depth" in m]
        fill = [m["prefetch_fill"] for _, m in rank0 if "prefetch_fill" in m]
        caps = [c for c in capacity_by_rank.values() if c > 0]
        rate = samples / elapsed if elapsed > 0 else 0.0
        phases = dict(phases_by_rank or {})
        phases.setdefault(0, [m for _, m in rank0])
        ranks = {str(r): {**{k: sum(float(m.get(k, 0.0)) for m in ms) / len(ms)
                             for k in _PHASE_KEYS}, "reports": len(ms)}
                 for r, ms in sorted(phases.items()) if ms}
        worst = {k: max((v[k] for v in ranks.values()), default=total(k) / n)
                 for k in _PHASE_KEYS}
        return cls(version=version, steps=n, first_step=rank0[0][0], last_step=rank0[-1][0],
                   samples_per_s=rate, step_s=elapsed / n,
                   data_wait_s=worst["data_wait_s"], compute_s=worst["compute_s"],
                   optimizer_s=worst["optimizer_s"], comm_wait_s=worst["comm_wait_s"],
                   ranks=ranks,
                   data_wait_share=min(1.0, worst["data_wait_s"] * n / elapsed)
                   if elapsed else 0.0,
                   memory_bytes=max(memory_by_rank.values(), default=0.0),
                   memory_capacity_bytes=min(caps) if caps else 0.0,
                   prefetch_depth=(sum(depth) / len(depth)) if depth else -1.0,
                   world_size=world_size, samples=samples, elapsed_s=elapsed,
                   window_rates=(rate,),
                   prefetch_fill=(sum(fill) / len(fill)) if fill else -1.0)

    @classmethod
    def merge(cls, windows: list[WindowSummary]) -> WindowSummary:
        """One summary of several windows of the same version: totals over all of them
        (samples over wall time, phase means weighted by steps, the largest memory
        peak), and every window's own rate in ``window_rates``.

        Raises:
            ValueError: ``windows`` is empty.
        """
        if not windows:
            raise ValueError("merge() needs at least one window")
        if len(windows) == 1:
            return windows[0]
        steps = sum(w.steps for w in windows)
        samples = sum(w.samples for w in windows)
        elapsed = sum(w.elapsed_s for w in windows)

        def mean(key: str) -> float:
            return sum(getattr(w, key) * w.steps for w in windows) / steps

        caps = [w.memory_capacity_bytes for w in windows if w.memory_capacity_bytes > 0]
        depth = [w.prefetch_depth for w in windows if w.prefetch_depth >= 0]
        fill = [w.prefetch_fill for w in windows if w.prefetch_fill >= 0]
        wait = sum(w.data_wait_s * w.steps for w in windows)
        ranks: dict[str, dict] = {}
        for w in windows:  # each rank's means, weighted by its reports
            for r, ph in w.ranks.items():
                acc = ranks.setdefault(r, {**dict.fromkeys(_PHASE_KEYS, 0.0), "reports": 0})
                for k in _PHASE_KEYS:
                    acc[k] += ph.get(k, 0.0) * ph["reports"]
                acc["reports"] += ph["reports"]
        for acc in ranks.values():
            for k in _PHASE_KEYS:
                acc[k] /= max(1, acc["reports"])
        return cls(version=windows[-1].version, steps=steps, first_step=windows[0].first_step,
                   last_step=windows[-1].last_step,
                   samples_per_s=samples / elapsed if elapsed > 0 else 0.0,
                   step_s=elapsed / steps, data_wait_s=mean("data_wait_s"),
                   compute_s=mean("compute_s"), optimizer_s=mean("optimizer_s"),
                   comm_wait_s=mean("comm_wait_s"), ranks=ranks,
                   data_wait_share=min(1.0, wait / elapsed) if elapsed else 0.0,
                   memory_bytes=max(w.memory_bytes for w in windows),
                   memory_capacity_bytes=min(caps) if caps else 0.0,
                   prefetch_depth=sum(depth) / len(depth) if depth else -1.0,
                   world_size=windows[-1].world_size, samples=samples, elapsed_s=elapsed,
                   window_rates=tuple(r for w in windows for r in w.window_rates),
                   prefetch_fill=sum(fill) / len(fill) if fill else -1.0)


class TunerBase:
    """Base class of tuners. Subclass, set ``defaults``, implement :meth:`propose`.

    Attributes:
        defaults: option name -> default value; the job's ``tuning.options.<name>``
            override them; an option not in ``defaults`` is refused at spec load.
        name: the registered name (set by the master).
    """

    defaults: ClassVar[dict[str, Any]] = {}
    name: str = ""

    def __init__(self, options: dict | None = None) -> None:
        self.validate_options(options or {})
        self.options: dict[str, Any] = {**self.defaults, **(options or {})}

    @classmethod
    def validate_options(cls, options: dict) -> None:
        """Check the job's options for this tuner at spec load, before anything starts.
        The base checks that every key is in ``defaults`` and that its type matches the
        default's (an int is accepted for a float); override to check ranges too (call
        ``super().validate_options(options)`` first).

        Raises:
            ValueError: ``"<key>: <value> is invalid; allowed: ..."`` for the first bad one.
        """
        if not isinstance(options, dict):
            raise ValueError(f"{options!r} is invalid; allowed: a mapping of option -> value")
        for key, value in options.items():
            if key not in cls.defaults:
                raise ValueError(f"{key}: unknown option; allowed: "
                                 + (", ".join(sorted(cls.defaults)) or "none"))
            want = cls.defaults[key]
            if want is None:
                continue
            ok = isinstance(value, type(want)) and not (isinstance(value, bool)
                                                        and not isinstance(want, bool))
            if isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise ValueError(f"{key}: {value!r} is invalid; allowed: a "
                                 f"{type(want).__name__} (default {want!r})")

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        """Return the changes to try next, as ``{section: {key: value}}`` (e.g.
        ``{"dataloader": {"num_workers": 4}}``), or ``None`` to keep ``current``.
        Called in the master once the current config was measured. An exception is
        logged as a ``tuning_tuner_failed`` event and the tuner is skipped this round."""
        raise NotImplementedError

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        """The guard's verdict on this tuner's last proposal: ``accepted`` (kept) or
        reverted; ``before``/``after``: the windows before and under the change
        (``after`` is ``None`` when the change never ran, e.g. it was invalid)."""

    def out_of_memory(self, failed: TuningConfig) -> None:
        """A rank ran out of memory under ``failed`` (a version this or another tuner
        proposed); the ranks already rolled back. Record what it means for later
        proposals (the controller itself never proposes a micro-batch at or above
        ``failed.dataloader.batch_size`` again). Called in the master."""

    def state_dict(self) -> dict:
        """JSON-able state persisted with the job (a restarted master restores it)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
