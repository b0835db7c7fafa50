"""A user's own MPMD graph with a stateful role outside the templates' base classes
(docs/failover.md, "Stateful roles"): ``feeder`` (stateless) makes each iteration's
batch; ``learner`` trains a small linear model on it with SGD and momentum and declares
its state with a ``state_dict`` / ``load_state_dict`` pair; :class:`CommitDriver` commits
at each iteration boundary (``BaseTrainer.commit_roles``) and resumes with
``BaseTrainer.resume_roles``. Deterministic: seeded model, one torch thread, batches
seeded by iteration."""

from __future__ import annotations

import time
import zlib

import torch

from dlrover_core import BaseTrainer, BaseWorkload

BATCH = 8


class Feeder(BaseWorkload):
    def make(self, it: int) -> dict:
        g = torch.Generator().manual_seed(1000 + int(it))
        x = torch.randn(BATCH, 4, generator=g)
        return {"x": x, "y": x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])}


class Learner(BaseWorkload):
    def setup(self) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.seen = 0

    # the declared state: saved at the driver's commit, loaded on a restart
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.seen = state["seen"]

    def learn(self, batch: list) -> float:
        batch = batch[0] if isinstance(batch, list) else batch
        time.sleep(float(self.config.get("step_sleep_s", 0.0)))
        loss = torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.seen += len(batch["x"])
        return float(loss)

    def digest(self) -> dict:
        """crc32 of the model's and the optimizer's tensors' bytes, and the count."""
        crc = 0
        tensors = list(self.model.state_dict().values()) + [
            s["momentum_buffer"] for s in self.opt.state.values()]
        for t in tensors:
            crc = zlib.crc32(t.detach().numpy().tobytes(), crc)
        return {"crc": crc, "seen": self.seen}


class CommitDriver(BaseTrainer):
    def init(self) -> None:
        state = self.resume_roles() or {}
        self.start = int(state.get("committed_step", 0))
        self.losses = list(state.get("losses", []))

    def fit(self) -> dict:
        n = int(self.config.iterations)
        for it in range(self.start, n):
            batch = self.RG_FEEDER.make.options(blocking=False, target="RANK0")(it)
            [loss] = self.RG_LEARNER.learn(batch)
            self.losses.append(loss)
            self.commit_roles(it + 1, {"losses": self.losses})
            self.report(it, loss=loss, iterations_done=float(len(self.losses)))
        [d] = self.RG_LEARNER.digest()
        out = {"weights_crc": float(d["crc"]), "seen": float(d["seen"]),
               "iterations_done": float(len(self.losses)), "loss_sum": sum(self.losses)}
        self.report(n - 1, **out)
        return out
