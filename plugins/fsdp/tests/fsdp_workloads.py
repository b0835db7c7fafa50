"""Workloads for the fsdp plugin's tests (imported by Ray workers as
``plugins.fsdp.tests.fsdp_workloads``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Sharded(BaseWorkload):
    def setup(self):
        torch.manual_seed(0)
        self.model = self.backend.wrap(TinyModel())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0}

    def train(self, steps: int) -> list[float]:
        losses = []
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * self.rank + s)
            x = torch.randn(8, 16, generator=g)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(float(t) / self.world_size)
        self.extra["step"] += steps
        return losses

    def full_state(self) -> dict:
        """Full (unsharded) parameters and optimizer moments, as plain tensors."""
        from torch.distributed.tensor import DTensor

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

        out = {f"p.{k.removeprefix('module.')}": full(v)
               for k, v in self.model.state_dict().items()}
        for i, p in enumerate(self.model.parameters()):
            st = self.opt.state.get(p, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in st:
                    out[f"o.{i}.{name}"] = full(st[name])
        out["step"] = torch.tensor(self.extra["step"])
        return out

    def local_numel(self) -> int:
        from torch.distributed.tensor import DTensor

        return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                   for p in self.model.parameters())

    def save(self, step: int) -> None:
        self.checkpointer.save(step, model=self.model, optimizer=self.opt, extra=self.extra)

    def load(self) -> int | None:
        return self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)

    def use_checkpoint_dir(self, job_dir: str) -> None:
        """Save and load under ``job_dir`` with the disk saver (keep 2), from now on."""
        self._context.job_dir = job_dir
        self._context.checkpoint = {"saver": "disk", "keep": 2}
        self._checkpointer = None

    def scramble(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0).add_(3.0)
        self.extra["step"] = -1


class ReplicaTrainer(BaseWorkload):
    """A DDP job's trainer for the heal test (``test_ddp_heal``): a small MLP with
    dropout (so the CPU random state matters), AdamW, per-(rank, step) batches,
    ``maybe_save`` every step (saving every ``checkpoint.every_steps``). Before step
    ``config.pause_step`` every rank waits for the file ``config.pause_until`` (the test
    kills a rank meanwhile, then creates it). At the end each rank writes its model,
    optimizer, step and CPU random state to ``<job_dir>/final-<rank>.pt``."""

    def setup(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
        self.model = self.backend.wrap(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        self.start = int(self.extra["step"]) if loaded is not None else 0

    def run(self) -> int:
        import os
        import time

        c = self.config
        for step in range(self.start, int(c.steps)):
            if step == int(c.pause_step):
                deadline = time.monotonic() + 600
                while not os.path.exists(str(c.pause_until)) and time.monotonic() < deadline:
                    time.sleep(0.05)
            g = torch.Generator().manual_seed(1000 * self.rank + step)
            x = torch.randn(8, 16, generator=g)
            loss = self.model(x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.report(step, loss=loss.item())
            self.extra["step"] = step + 1
            self.checkpointer.maybe_save(step + 1, model=self.model, optimizer=self.opt,
                                         extra=self.extra)
        inner = getattr(self.model, "module", self.model)
        torch.save({"model": inner.state_dict(), "optimizer": self.opt.state_dict(),
                    "step": self.extra["step"], "rng": torch.get_rng_state()},
                   os.path.join(self.job_dir, f"final-{self.rank}.pt"))
        return int(self.extra["step"])
