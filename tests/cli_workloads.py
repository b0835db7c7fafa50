"""A small DDP workload for the CLI tests: it prints every step (stdout) and its
set-up (stderr), so ``dlrover logs`` has something per attempt, and checkpoints."""

from __future__ import annotations

import sys
import time

from dlrover_core import BaseTrainer, BaseWorkload


class Chatty(BaseWorkload):
    def setup(self):
        import torch

        torch.manual_seed(0)
        self.model = self.backend.wrap(torch.nn.Linear(4, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.extra = {"step": 0}
        self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        print(f"setup rank {self.rank} attempt {self.context.attempt} "
              f"from step {self.extra['step']}", file=sys.stderr, flush=True)

    def run(self):
        for step in range(self.extra["step"], int(self.config.max_steps)):
            self.train_step(step)
            time.sleep(float(self.config.get("step_s", 0.2)))

    def train_step(self, step: int) -> None:
        """One SGD step; prints its loss, reports it and saves when the spec says."""
        import torch

        x = torch.full((2, 4), float(self.rank + 1))
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        print(f"rank {self.rank} step {step} loss {loss.item():.4f}", flush=True)
        self.report(step, loss=loss.item())
        self.extra["step"] = step + 1
        self.checkpointer.maybe_save(step + 1, model=self.model, optimizer=self.opt,
                                     extra=self.extra)


class ChattyDriver(BaseTrainer):
    """An MPMD driver that prints what the ``worker`` role answers."""

    def fit(self):
        for it in range(int(self.config.get("iterations", 2))):
            who = self.RG_WORKER.whoami()
            print(f"driver iteration {it}: worker ranks {[w['rank'] for w in who]}", flush=True)
            self.report(it, it=float(it))
        print("driver done", file=sys.stderr, flush=True)


class FlakyChatty(Chatty):
    """Chatty whose rank ``config.fail_rank`` raises in its first attempt during step
    ``config.fail_step`` (after reporting the step before it)."""

    def train_step(self, step: int) -> None:
        if (self.context.attempt == 0 and self.rank == int(self.config.fail_rank)
                and step == int(self.config.fail_step)):
            raise RuntimeError(f"flaky rank {self.rank} during step {step}")
        super().train_step(step)
