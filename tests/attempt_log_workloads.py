"""A DDP workload for tests/test_attempt_log.py: it logs through :mod:`logging`, warns
through :mod:`warnings`, checkpoints, and (rank 1, attempt 0) raises at one step."""

from __future__ import annotations

import logging
import warnings

from dlrover_core import BaseWorkload

user_log = logging.getLogger("user.workload")


class Logged(BaseWorkload):
    def setup(self):
        import torch

        torch.manual_seed(0)
        self.model = self.backend.wrap(torch.nn.Linear(4, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.extra = {"step": 0}
        self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        user_log.info("user record: rank %d set up", self.rank)
        warnings.warn(f"user warning from rank {self.rank}", UserWarning)

    def run(self):
        import torch

        for step in range(self.extra["step"], int(self.config.max_steps)):
            if step == int(self.config.fail_at) and self.rank == 1 and self.context.attempt == 0:
                raise RuntimeError(f"injected failure at step {step}")
            loss = self.model(torch.ones(2, 4)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.report(step, loss=loss.item())
            self.extra["step"] = step + 1
            self.checkpointer.maybe_save(step + 1, model=self.model, optimizer=self.opt,
                                         extra=self.extra)
