"""Workloads of tests/test_master_startup.py (imported by the Ray workers)."""

from __future__ import annotations

from dlrover_core import BaseTrainer, BaseWorkload


class FlakySetup(BaseWorkload):
    """Rank 1 raises a transient error in its first ``setup()`` (attempt 0) only."""

    def setup(self):
        if self.rank == 1 and self._context.attempt == 0:
            raise ConnectionError("transient: the data store is not reachable yet")

    def attempt_seen(self):
        return self._context.attempt


class CountDriver(BaseTrainer):
    """Asks every worker for its attempt, reports three iterations."""

    def fit(self):
        attempts = self.RG_WORKER.attempt_seen.options(auto_shard=False)()
        for it in range(3):
            self.report(it, it=float(it + 1), min_attempt=float(min(attempts)))
        return attempts
