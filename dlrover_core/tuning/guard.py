"""The guard: a change is kept only if it did not make things worse.

After the ranks switched to a new version, the master measures one window under it
and compares it with the window before (:class:`~dlrover_core.tuning.tuner.WindowSummary`):
the change is reverted when the median throughput fell by more than ``tolerance``
(a fraction, relative to before) or when any rank's memory peak crossed the limit
(``memory_limit_bytes``, or, when that is 0, the smallest capacity a rank reported
minus ``memory_headroom`` of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrover_core.tuning.tuner import WindowSummary


@dataclass(frozen=True)
class GuardVerdict:
    keep: bool
    reason: str


@dataclass(frozen=True)
class Guard:
    """``tolerance``: accepted relative throughput loss (0.05 = 5 %);
    ``memory_limit_bytes``: per-rank memory limit, bytes (0: from the reported capacity);
    ``memory_headroom``: fraction of the capacity kept free when the limit comes from it."""

    tolerance: float = 0.05
    memory_limit_bytes: int = 0
    memory_headroom: float = 0.1

    def memory_limit(self, window: WindowSummary) -> float:
        """The limit in bytes for ``window`` (0: none known)."""
        if self.memory_limit_bytes > 0:
            return float(self.memory_limit_bytes)
        if window.memory_capacity_bytes > 0:
            return window.memory_capacity_bytes * (1.0 - self.memory_headroom)
        return 0.0

    def judge(self, before: WindowSummary, after: WindowSummary) -> GuardVerdict:
        limit = self.memory_limit(after)
        if limit and after.memory_bytes > limit:
            return GuardVerdict(False, f"memory peak {after.memory_bytes / 2**20:.0f} MiB "
                                       f"crossed the limit {limit / 2**20:.0f} MiB")
        floor = before.samples_per_s * (1.0 - self.tolerance)
        if after.samples_per_s < floor:
            return GuardVerdict(False, f"throughput fell from {before.samples_per_s:.1f} to "
                                       f"{after.samples_per_s:.1f} samples/s (more than "
                                       f"{self.tolerance:.0%})")
        return GuardVerdict(True, f"throughput {before.samples_per_s:.1f} -> "
                                  f"{after.samples_per_s:.1f} samples/s")
