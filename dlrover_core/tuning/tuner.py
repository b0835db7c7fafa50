"""The tuner plugin interface: ``TunerBase`` and the window summary it reads.

A tuner is registered through the ``dlrover_tuners`` hook as a
:class:`~dlrover_core.plugins.records.Tuner` record naming a ``TunerBase`` subclass by
import path. The JobMaster constructs one instance per job (``cls(options)`` with the
job's ``tuning.options.<name>``) and, every ``tuning.interval_steps`` steps, calls
:meth:`TunerBase.propose` with a :class:`WindowSummary` of the steps measured under
the current :class:`~dlrover_core.tuning.config.TuningConfig`. After the proposal was
tried, :meth:`TunerBase.feedback` says whether the guard kept or reverted it.

Tuner modules run in the client (option validation) and the master: they must import
nothing heavy (torch, megatron).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from dlrover_core.tuning.config import TuningConfig


@dataclass(frozen=True)
class WindowSummary:
    """What the ranks reported over one measurement window of one config version.

    Attributes:
        version: the ``TuningConfig`` version the window ran under.
        steps: steps in the window; ``first_step``/``last_step``: their range.
        samples_per_s: median over the window's steps of rank 0's global samples/s.
        step_s, data_wait_s, compute_s, optimizer_s: medians over steps, seconds (rank 0).
        data_wait_share: ``data_wait_s / step_s`` (0..1).
        memory_bytes: the largest per-step memory peak of any rank (CUDA
            ``max_memory_allocated`` where reported, else peak RSS), bytes.
        memory_capacity_bytes: the smallest capacity any rank reported, bytes (0: unknown).
        prefetch_depth: mean ready batches in rank 0's loader queue (-1: not reported).
        world_size: data-parallel ranks of the tuned role.
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

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_reports(cls, version: int, rank0: list[tuple[int, dict]],
                     memory_by_rank: dict[int, float], capacity_by_rank: dict[int, float],
                     world_size: int) -> WindowSummary:
        """Summarise rank 0's ``(step, metrics)`` reports and every rank's memory peaks.

        Raises:
            ValueError: ``rank0`` is empty.
        """
        if not rank0:
            raise ValueError("a window needs at least one step report")

        def med(key: str) -> float:
            vals = [m[key] for _, m in rank0 if key in m]
            return float(statistics.median(vals)) if vals else 0.0

        step_s = med("step_s")
        depth = [m["prefetch_depth"] for _, m in rank0 if "prefetch_depth" in m]
        caps = [c for c in capacity_by_rank.values() if c > 0]
        return cls(version=version, steps=len(rank0), first_step=rank0[0][0],
                   last_step=rank0[-1][0], samples_per_s=med("samples_per_s"), step_s=step_s,
                   data_wait_s=med("data_wait_s"), compute_s=med("compute_s"),
                   optimizer_s=med("optimizer_s"),
                   data_wait_share=(med("data_wait_s") / step_s) if step_s > 0 else 0.0,
                   memory_bytes=max(memory_by_rank.values(), default=0.0),
                   memory_capacity_bytes=min(caps) if caps else 0.0,
                   prefetch_depth=(sum(depth) / len(depth)) if depth else -1.0,
                   world_size=world_size)


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
        Called in the master every ``tuning.interval_steps`` steps. An exception is
        logged as a ``tuning_tuner_failed`` event and the tuner is skipped this round."""
        raise NotImplementedError

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        """The guard's verdict on this tuner's last proposal: ``accepted`` (kept) or
        reverted; ``before``/``after``: the windows before and under the change
        (``after`` is ``None`` when the change never ran, e.g. it was invalid)."""

    def state_dict(self) -> dict:
        """JSON-able state persisted with the job (a restarted master restores it)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
