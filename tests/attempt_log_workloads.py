"""A DDP workload for tests/test_attempt_log.py: :class:`tests.cli_workloads.Chatty`
that also logs through :mod:`logging`, warns through :mod:`warnings`, and (rank 1,
attempt 0) raises at step ``config.fail_at``."""

from __future__ import annotations

import logging
import warnings

from tests.cli_workloads import Chatty

user_log = logging.getLogger("user.workload")


class Logged(Chatty):
    def setup(self):
        super().setup()
        user_log.info("user record: rank %d set up", self.rank)
        warnings.warn(f"user warning from rank {self.rank}", UserWarning)

    def train_step(self, step: int) -> None:
        if step == int(self.config.fail_at) and self.rank == 1 and self.context.attempt == 0:
            raise RuntimeError(f"injected failure at step {step}")
        super().train_step(step)
